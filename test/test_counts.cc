// One way to report a count (docs/api.md): every bico_X_count is
// `bico_status bico_X_count(const bico_X *h, size_t *n)`, BICO_E_NULL for a
// NULL handle (nothing written) or a NULL n (the handle's context says so),
// so a caller tells "none" from "bad handle".  Each count is checked
// against a number planted from outside: a safetensors file composed byte
// by byte, a model and an adapter built entry by entry.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "st_testutil.h"
#include "testutil.h"

namespace {

std::string errmsg(bico_ctx *ctx) { return bico_ctx_errmsg(ctx); }

// The NULL cases every count shares: a NULL handle leaves *n alone and
// touches no context (it has none); a NULL n is BICO_E_NULL with the
// handle's context naming the function and the argument.
template <class H>
void null_cases(bico_status (*fn)(const H *, size_t *), const H *h,
                bico_ctx *ctx, const std::string &name) {
  size_t n = 12345;
  EXPECT_EQ(fn(nullptr, &n), BICO_E_NULL) << name;
  EXPECT_EQ(n, 12345u) << name;
  EXPECT_EQ(fn(nullptr, nullptr), BICO_E_NULL) << name;
  EXPECT_EQ(fn(h, nullptr), BICO_E_NULL) << name;
  EXPECT_EQ(bico_ctx_errcode(ctx), BICO_E_NULL) << name;
  EXPECT_TRUE(stt::contains(errmsg(ctx), name + ": n is NULL"))
      << name << ": " << errmsg(ctx);
}

// A safetensors header of `nt` one-element F32 tensors t0.. and `nm`
// metadata entries k0.. (values v0..), with its data.
std::string st_file(size_t nt, size_t nm, size_t first = 0) {
  std::string h = "{";
  if (nm > 0) {
    h += "\"__metadata__\":{";
    for (size_t i = 0; i < nm; i++)
      h += (i ? "," : "") + std::string("\"k") + std::to_string(i) +
           "\":\"v" + std::to_string(i) + "\"";
    h += "}";
  }
  std::vector<float> data;
  for (size_t i = 0; i < nt; i++) {
    h += (i || nm ? "," : "") + std::string("\"t") +
         std::to_string(first + i) +
         "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" +
         std::to_string(4 * i) + "," + std::to_string(4 * i + 4) + "]}";
    data.push_back((float)i);
  }
  h += "}";
  return stt::st_bytes(h, stt::f32_bytes(data));
}

}  // namespace

TEST(Counts, StfileCountsArePlantedTensorsAndMetadata) {
  bt::Ctx ctx;
  stt::TempDir dir;
  bt::Rng g(25);
  for (int round = 0; round < 4; round++) {
    size_t nt = g.next() % 9, nm = g.next() % 5;  // zero included
    std::string path = dir / ("f" + std::to_string(round) + ".safetensors");
    stt::write_bytes(path, st_file(nt, nm));
    stt::File f;
    ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK)
        << errmsg(ctx);
    size_t n = 99;
    ASSERT_EQ(bico_stfile_count(f, &n), BICO_OK);
    EXPECT_EQ(n, nt);
    n = 99;
    ASSERT_EQ(bico_stfile_metadata_count(f, &n), BICO_OK);
    EXPECT_EQ(n, nm);
    null_cases(bico_stfile_count, (const bico_stfile *)f, ctx, "stfile_count");
    null_cases(bico_stfile_metadata_count, (const bico_stfile *)f, ctx,
               "stfile_metadata_count");
  }
}

TEST(Counts, StfileCountOfShardsIsTheirSum) {
  bt::Ctx ctx;
  stt::TempDir dir;
  // Shard sizes 3 and 5, tensors t0..t2 and t3..t7; the index's metadata
  // has two entries (shards' own metadata are not the checkpoint's).
  stt::write_bytes(dir / "s1.safetensors", st_file(3, 1, 0));
  stt::write_bytes(dir / "s2.safetensors", st_file(5, 0, 3));
  std::string map;
  for (size_t i = 0; i < 8; i++)
    map += (i ? "," : "") + std::string("\"t") + std::to_string(i) +
           "\":\"" + (i < 3 ? "s1" : "s2") + ".safetensors\"";
  stt::write_bytes(dir / "model.safetensors.index.json",
                   "{\"metadata\":{\"total_size\":32,\"note\":\"x\"},"
                   "\"weight_map\":{" + map + "}}");
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, (dir / "model.safetensors.index.json").c_str(),
                             &f.f),
            BICO_OK)
      << errmsg(ctx);
  EXPECT_EQ(bt::count(bico_stfile_count, f), 3u + 5u);
  EXPECT_EQ(bt::count(bico_stfile_metadata_count, f), 2u);
}

TEST(Counts, ModelCountsArePlantedTensorsAndModules) {
  bt::Ctx ctx;
  bt::Rng g(7);
  for (int round = 0; round < 4; round++) {
    bico_model *m = nullptr;
    ASSERT_EQ(bico_model_create(ctx, &m), BICO_OK);
    // k linear modules m<i> (weight, and a bias for every other one): k
    // modules, k + ceil(k / 2) tensors.
    size_t k = 1 + g.next() % 7, tensors = 0;
    for (size_t i = 0; i < k; i++) {
      std::string base = "m" + std::to_string(i);
      size_t w[2] = {3, 2}, b[1] = {3};
      ASSERT_EQ(bico_model_add_tensor(m, (base + ".weight").c_str(), 0, 2, w),
                BICO_OK);
      tensors++;
      if (i % 2 == 0) {
        ASSERT_EQ(bico_model_add_tensor(m, (base + ".bias").c_str(), 0, 1, b),
                  BICO_OK);
        tensors++;
      }
    }
    size_t n = 99;
    ASSERT_EQ(bico_model_tensor_count(m, &n), BICO_OK);
    EXPECT_EQ(n, tensors);
    n = 99;
    ASSERT_EQ(bico_model_module_count(m, &n), BICO_OK) << errmsg(ctx);
    EXPECT_EQ(n, k);
    for (size_t i = 0; i < k; i++) {
      size_t idx;
      EXPECT_EQ(bico_model_find_module(m, ("m" + std::to_string(i)).c_str(),
                                       &idx),
                BICO_OK);
    }
    null_cases(bico_model_tensor_count, (const bico_model *)m, ctx,
               "model_tensor_count");
    null_cases(bico_model_module_count, (const bico_model *)m, ctx,
               "model_module_count");
    bico_model_free(m);
  }
}

// A model whose analysis fails (a block prefix no tensor uses) says so
// through its module count, which read 0 ("no modules") before.
TEST(Counts, ModelModuleCountReportsAFailedAnalysis) {
  bt::Ctx ctx;
  bico_model *m = nullptr;
  ASSERT_EQ(bico_model_create(ctx, &m), BICO_OK);
  size_t w[2] = {3, 2};
  ASSERT_EQ(bico_model_add_tensor(m, "layers.0.fc.weight", 0, 2, w), BICO_OK);
  ASSERT_EQ(bico_model_set_blocks(m, "nowhere"), BICO_OK);
  size_t n = 99;
  EXPECT_EQ(bico_model_module_count(m, &n), BICO_E_NOTFOUND);
  EXPECT_EQ(n, 99u);
  EXPECT_TRUE(stt::contains(errmsg(ctx), "nowhere")) << errmsg(ctx);
  // The tensors are there all the same.
  EXPECT_EQ(bt::count(bico_model_tensor_count, m), 1u);
  ASSERT_EQ(bico_model_set_blocks(m, nullptr), BICO_OK);
  EXPECT_EQ(bt::count(bico_model_module_count, m), 1u);
  bico_model_free(m);
}

TEST(Counts, LoraCountsArePlantedModulesAndSavedTensors) {
  bt::Ctx ctx;
  stt::TempDir dir;
  bt::Rng g(11);
  for (int round = 0; round < 3; round++) {
    bico_lora *l = nullptr;
    ASSERT_EQ(bico_lora_create(ctx, &l), BICO_OK);
    size_t nm = 1 + g.next() % 5, ns = g.next() % 4;
    float b[2] = {1, 2}, a[3] = {1, 0, -1};
    for (size_t i = 0; i < nm; i++)
      ASSERT_EQ(bico_lora_add_module(l, ("m" + std::to_string(i)).c_str(),
                                     BICO_LORA_LINEAR, 1, 2, 3, 2.0, b, a),
                BICO_OK)
          << errmsg(ctx);
    for (size_t i = 0; i < ns; i++) {
      std::string mod = "head" + std::to_string(i);
      size_t shape[1] = {2};
      ASSERT_EQ(bico_lora_add_saved(l, (mod + ".weight").c_str(), mod.c_str(),
                                    1, shape, b),
                BICO_OK)
          << errmsg(ctx);
    }
    size_t n = 99;
    ASSERT_EQ(bico_lora_module_count(l, &n), BICO_OK);
    EXPECT_EQ(n, nm);
    n = 99;
    ASSERT_EQ(bico_lora_saved_count(l, &n), BICO_OK);
    EXPECT_EQ(n, ns);
    null_cases(bico_lora_module_count, (const bico_lora *)l, ctx,
               "lora_module_count");
    null_cases(bico_lora_saved_count, (const bico_lora *)l, ctx,
               "lora_saved_count");
    // Written and read back: the same counts from the files.
    std::string out = dir / ("a" + std::to_string(round));
    ASSERT_EQ(bico_lora_save(l, out.c_str()), BICO_OK) << errmsg(ctx);
    bico_lora *back = nullptr;
    ASSERT_EQ(bico_lora_open(ctx, out.c_str(), &back), BICO_OK)
        << errmsg(ctx);
    EXPECT_EQ(bt::count(bico_lora_module_count, back), nm);
    EXPECT_EQ(bt::count(bico_lora_saved_count, back), ns);
    bico_lora_free(back);
    bico_lora_free(l);
  }
}
