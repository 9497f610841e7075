// Replays every fuzzing input kept in the repository (the seed corpora in
// test/fuzz/corpus/<target>/ and the crash reproducers in
// test/fuzz/regressions/<target>/) through the public API, the way each
// libFuzzer target feeds it, and expects a clean outcome: success with
// consistent answers, or an error status with a message, never a crash
// (run `make check SANITIZE=1` for memory errors).  The fuzzers themselves
// run with `make fuzz` (docs/reliability.md).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "bico/safetensors.h"
#include "bico/lora.h"
#include "bico/transfer.h"
#include "st_testutil.h"
#include "testutil.h"

namespace {

namespace fs = std::filesystem;
using stt::TempDir;

// test/fuzz, found from this file's path (make compiles it as
// test/test_fuzz_regressions.cc from the repository root) unless
// BICO_SOURCE_DIR names the repository.
fs::path fuzz_root() {
  const char *src = std::getenv("BICO_SOURCE_DIR");
  if (src && *src) return fs::path(src) / "test" / "fuzz";
  return fs::path(__FILE__).parent_path() / "fuzz";
}

struct Input {
  std::string name, bytes;
};

// Every file of corpus/<target> and regressions/<target>.
std::vector<Input> inputs(const std::string &target) {
  std::vector<Input> v;
  for (const char *kind : {"corpus", "regressions"}) {
    fs::path d = fuzz_root() / kind / target;
    if (!fs::is_directory(d)) continue;
    for (auto &e : fs::directory_iterator(d))
      if (e.is_regular_file())
        v.push_back({std::string(kind) + "/" + target + "/" +
                         e.path().filename().string(),
                     stt::read_bytes(e.path().string())});
  }
  return v;
}

void expect_clean_failure(bico_ctx *ctx, bico_status st) {
  EXPECT_NE(st, BICO_OK);
  EXPECT_NE(st, BICO_E_INTERNAL) << bico_ctx_errmsg(ctx);
  EXPECT_STRNE(bico_ctx_errmsg(ctx), "");
}

// Reads every tensor of an accepted file; returns the total data bytes.
size_t read_all(bico_ctx *ctx, bico_stfile *f) {
  size_t total = 0;
  for (size_t i = 0; i < bt::count(bico_stfile_count, f); i++) {
    size_t numel = 0, nbytes = 0;
    EXPECT_EQ(bico_stfile_tensor_size(f, i, &numel, &nbytes), BICO_OK);
    total += nbytes;
    std::vector<float> x(numel + 1);
    std::vector<double> y(numel + 1);
    EXPECT_EQ(bico_stfile_read_f32(f, i, x.data(), numel), BICO_OK)
        << bico_ctx_errmsg(ctx);
    EXPECT_EQ(bico_stfile_read_f64(f, i, y.data(), numel), BICO_OK)
        << bico_ctx_errmsg(ctx);
    bool finite = true;
    for (size_t k = 0; k < numel; k++) finite = finite && std::isfinite(y[k]);
    EXPECT_EQ(bico_stfile_check_finite(f, i),
              finite ? BICO_OK : BICO_E_NONFINITE);
  }
  return total;
}

// Opens `path` and checks the outcome; `size` is the file's byte count
// when the tensors must tile it exactly (single files), else 0.
void open_and_check(const std::string &path, const std::string &bytes,
                    bool single) {
  bt::Ctx ctx;
  bico_stfile *f = nullptr;
  bico_status st = bico_stfile_open(ctx, path.c_str(), &f);
  if (st != BICO_OK) {
    expect_clean_failure(ctx, st);
    EXPECT_EQ(f, nullptr);
    return;
  }
  size_t total = read_all(ctx, f);
  if (single) {
    ASSERT_GE(bytes.size(), 8u);
    uint64_t n = 0;
    for (int k = 0; k < 8; k++) n |= (uint64_t)(unsigned char)bytes[k] << (8 * k);
    EXPECT_EQ(total, bytes.size() - 8 - n);
  }
  bico_stfile_free(f);
}

TEST(FuzzRegressions, Safetensors) {
  auto in = inputs("fuzz_safetensors");
  ASSERT_FALSE(in.empty()) << "no inputs under " << fuzz_root();
  TempDir dir;
  for (auto &i : in) {
    SCOPED_TRACE(i.name);
    stt::write_bytes(dir / "input.safetensors", i.bytes);
    open_and_check(dir / "input.safetensors", i.bytes, true);
  }
}

// As fuzz_st_index.c: parts separated by "\n@@@\n"; the index first, then
// shards s0.safetensors .. s3.safetensors.
TEST(FuzzRegressions, ShardedIndex) {
  auto in = inputs("fuzz_st_index");
  ASSERT_FALSE(in.empty()) << "no inputs under " << fuzz_root();
  const std::string sep = "\n@@@\n";
  for (auto &i : in) {
    SCOPED_TRACE(i.name);
    TempDir dir;
    size_t pos = 0;
    for (int part = 0; part < 5; part++) {
      size_t q = part < 4 ? i.bytes.find(sep, pos) : std::string::npos;
      std::string chunk = i.bytes.substr(pos, q == std::string::npos ? std::string::npos : q - pos);
      std::string name = part == 0 ? "model.safetensors.index.json"
                                   : "s" + std::to_string(part - 1) + ".safetensors";
      stt::write_bytes(dir / name, chunk);
      if (q == std::string::npos) break;
      pos = q + sep.size();
    }
    open_and_check(dir / "model.safetensors.index.json", i.bytes, false);
  }
}

// The JSON parser is internal; its inputs reach it as a safetensors header.
TEST(FuzzRegressions, JsonAsSafetensorsHeader) {
  auto in = inputs("fuzz_json");
  ASSERT_FALSE(in.empty()) << "no inputs under " << fuzz_root();
  TempDir dir;
  for (auto &i : in) {
    SCOPED_TRACE(i.name);
    std::string bytes = stt::le64(i.bytes.size()) + i.bytes;
    stt::write_bytes(dir / "h.safetensors", bytes);
    open_and_check(dir / "h.safetensors", bytes, true);
  }
}

TEST(FuzzRegressions, XcovDeserialize) {
  auto in = inputs("fuzz_xcov");
  ASSERT_FALSE(in.empty()) << "no inputs under " << fuzz_root();
  for (auto &i : in) {
    SCOPED_TRACE(i.name);
    bt::Ctx ctx;
    bico_xcov *xc = nullptr;
    bico_status st = bico_xcov_deserialize(ctx, i.bytes.data(), i.bytes.size(), &xc);
    if (st != BICO_OK) {
      expect_clean_failure(ctx, st);
      EXPECT_EQ(xc, nullptr);
      continue;
    }
    // Bit-exact: serialising gives the input back.
    size_t len = 0, written = 0, d_a = 0, d_b = 0;
    unsigned flags = 0;
    ASSERT_EQ(bico_xcov_serialized_size(xc, &len), BICO_OK);
    std::string out(len, '\0');
    ASSERT_EQ(bico_xcov_serialize(xc, &out[0], len, &written), BICO_OK);
    EXPECT_EQ(out, i.bytes);
    ASSERT_EQ(bico_xcov_info(xc, &d_a, &d_b, nullptr, &flags), BICO_OK);
    // Centered statistics and the solve: finite results or a clean error.
    std::vector<double> c(d_a * d_b);
    if (flags & BICO_XCOV_SUMS) {
      st = bico_xcov_matrix(xc, BICO_XCOV_CROSS, 1, c.data(), d_b);
      if (st == BICO_OK) {
        for (double x : c) EXPECT_TRUE(std::isfinite(x));
      } else {
        expect_clean_failure(ctx, st);
      }
    }
    bico_procrustes *p = nullptr;
    ASSERT_EQ(bico_procrustes_create(ctx, &p), BICO_OK);
    if (flags & BICO_XCOV_SUMS) {
      ASSERT_EQ(bico_procrustes_set_param(p, BICO_PROC_CENTER, 1), BICO_OK);
    }
    std::vector<float> r(d_a * d_b);
    st = bico_procrustes_solve(p, xc, r.data(), d_b, nullptr);
    if (st == BICO_OK) {
      // Finite, and entries of a matrix with orthonormal rows or columns.
      for (float x : r) {
        EXPECT_TRUE(std::isfinite(x));
        EXPECT_LE(std::fabs(x), 1.0f + 1e-3f) << i.name;
      }
    } else {
      expect_clean_failure(ctx, st);
    }
    bico_procrustes_free(p);
    bico_xcov_free(xc);
  }
}

// As fuzz_lora.c: the config before the first "\n@@@\n", the safetensors
// file after it; an accepted adapter saves and reopens with the same modules.
TEST(FuzzRegressions, LoraAdapter) {
  auto in = inputs("fuzz_lora");
  ASSERT_FALSE(in.empty()) << "no inputs under " << fuzz_root();
  const std::string sep = "\n@@@\n";
  for (auto &i : in) {
    SCOPED_TRACE(i.name);
    TempDir dir;
    size_t q = i.bytes.find(sep);
    stt::write_bytes(dir / "adapter_config.json", i.bytes.substr(0, q));
    stt::write_bytes(dir / "adapter_model.safetensors",
                     q == std::string::npos ? "" : i.bytes.substr(q + sep.size()));
    bt::Ctx ctx;
    bico_lora *l = nullptr;
    bico_status st = bico_lora_open(ctx, dir.path.c_str(), &l);
    if (st != BICO_OK) {
      expect_clean_failure(ctx, st);
      EXPECT_EQ(l, nullptr);
      continue;
    }
    ASSERT_EQ(bico_lora_save(l, (dir / "saved").c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
    bico_lora *again = nullptr;
    ASSERT_EQ(bico_lora_open(ctx, (dir / "saved").c_str(), &again), BICO_OK)
        << bico_ctx_errmsg(ctx);
    EXPECT_EQ(bt::count(bico_lora_module_count, again), bt::count(bico_lora_module_count, l));
    for (size_t k = 0; k < bt::count(bico_lora_module_count, l); k++) {
      const char *name = nullptr;
      size_t r1 = 0, o1 = 0, i1 = 0, j = 0, r2 = 0, o2 = 0, i2 = 0;
      ASSERT_EQ(bico_lora_module(l, k, &name, nullptr, &r1, &o1, &i1, nullptr, nullptr),
                BICO_OK);
      ASSERT_EQ(bico_lora_find_module(again, name, &j), BICO_OK) << name;
      ASSERT_EQ(bico_lora_module(again, j, nullptr, nullptr, &r2, &o2, &i2, nullptr, nullptr),
                BICO_OK);
      EXPECT_EQ(r1, r2);
      EXPECT_EQ(o1, o2);
      EXPECT_EQ(i1, i2);
    }
    bico_lora_free(again);
    bico_lora_free(l);
  }
}

// As fuzz_calib_stats.c: byte 0 picks the input of a small valid transfer
// that the remaining bytes replace.
void write_f32_file(const std::string &path,
                    const std::vector<std::pair<std::string, std::vector<size_t>>> &ts,
                    float scale, uint32_t seed) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK);
  for (auto &t : ts)
    ASSERT_EQ(bico_stwriter_declare(w, t.first.c_str(), BICO_DTYPE_F32,
                                    t.second.size(), t.second.data()),
              BICO_OK);
  bt::Rng g(seed);
  for (auto &t : ts) {
    size_t n = 1;
    for (size_t e : t.second) n *= e;
    bt::Mat m = bt::randn(g, n, 1, scale);
    std::vector<float> v = m.f32();
    ASSERT_EQ(bico_stwriter_write_f32(w, t.first.c_str(), v.data(), n), BICO_OK);
  }
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
}

// True if a tensor of the votes file named like a parameter holds a value
// that is not an int32 (read here in double, which holds every int32).
bool votes_invalid(const std::string &path,
                   const std::vector<std::pair<std::string, std::vector<size_t>>> &params) {
  bt::Ctx ctx;
  bico_stfile *f = nullptr;
  if (bico_stfile_open(ctx, path.c_str(), &f) != BICO_OK) return false;
  bool bad = false;
  for (auto &p : params) {
    size_t idx = 0, numel = 0;
    if (bico_stfile_find(f, p.first.c_str(), &idx) != BICO_OK) continue;
    bico_stfile_tensor_size(f, idx, &numel, nullptr);
    std::vector<double> v(numel + 1);
    if (bico_stfile_read_f64(f, idx, v.data(), numel) != BICO_OK) continue;
    for (size_t k = 0; k < numel; k++)
      if (!(v[k] >= -2147483648.0 && v[k] <= 2147483647.0) ||
          v[k] != std::floor(v[k]))
        bad = true;
  }
  bico_stfile_free(f);
  return bad;
}

TEST(FuzzRegressions, CalibrationStatisticsVotes) {
  auto in = inputs("fuzz_calib_stats");
  ASSERT_FALSE(in.empty()) << "no inputs under " << fuzz_root();
  TempDir dir;
  const size_t d = 4, rows = 8;
  std::vector<std::pair<std::string, std::vector<size_t>>> params = {
      {"blocks.0.fc.weight", {d, d}}, {"blocks.0.fc.bias", {d}},
      {"blocks.1.fc.weight", {d, d}}, {"blocks.1.fc.bias", {d}}};
  std::vector<std::pair<std::string, std::vector<size_t>>> cal;
  for (const char *m : {"blocks.0.fc", "blocks.1.fc"})
    for (const char *s : {".input", ".output_grad"})
      cal.push_back({std::string(m) + s, {rows, d}});
  write_f32_file(dir / "A.safetensors", params, 1.0f, 1);
  write_f32_file(dir / "tau.safetensors", params, 0.1f, 2);
  write_f32_file(dir / "B.safetensors", params, 1.0f, 3);
  write_f32_file(dir / "calA.safetensors", cal, 1.0f, 4);
  write_f32_file(dir / "calB.safetensors", cal, 1.0f, 5);
  const std::string fz = dir / "fuzzed.safetensors", out = dir / "out.safetensors";
  for (auto &i : in) {
    SCOPED_TRACE(i.name);
    if (i.bytes.empty()) continue;
    unsigned char b0 = (unsigned char)i.bytes[0];
    int mode = (b0 & 7) % 5, center = (b0 >> 3) & 1, whiten = (b0 >> 4) & 1;
    stt::write_bytes(fz, i.bytes.substr(1));
    std::remove(out.c_str());
    bt::Ctx ctx;
    bico_status st;
    if (mode == 4) {
      st = bico_stats_from_calib(ctx, (dir / "calA.safetensors").c_str(),
                                 fz.c_str(), nullptr, out.c_str());
    } else {
      bico_transfer *t = nullptr;
      ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
      bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, (dir / "A.safetensors").c_str());
      bico_transfer_set_file(t, BICO_FILE_TASK_VECTOR, (dir / "tau.safetensors").c_str());
      bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, (dir / "B.safetensors").c_str());
      bico_transfer_set_file(t, BICO_FILE_OUTPUT, out.c_str());
      if (mode == 0) {
        bico_transfer_set_file(t, BICO_FILE_STATS, fz.c_str());
      } else if (mode == 1 || mode == 2) {
        bico_transfer_set_file(t, BICO_FILE_SOURCE_CALIB,
                               mode == 2 ? fz.c_str() : (dir / "calA.safetensors").c_str());
        bico_transfer_set_file(t, BICO_FILE_TARGET_CALIB,
                               mode == 1 ? fz.c_str() : (dir / "calB.safetensors").c_str());
        bico_transfer_set_param(t, BICO_TRANSFER_CENTER, center);
        bico_transfer_set_param(t, BICO_TRANSFER_WHITEN, whiten ? 0.5 : 0.0);
      } else {
        bico_transfer_set_param(t, BICO_TRANSFER_METHOD, BICO_METHOD_GRADFIX);
        bico_transfer_set_file(t, BICO_FILE_TARGET_VOTES, fz.c_str());
      }
      st = bico_transfer_run(t);
      bico_transfer_free(t);
    }
    // A votes file is int32 counts (docs/formats.md): a used tensor holding
    // anything else must be refused.  (Caught an overflow of 2^31 that UB
    // made pass silently.)
    if (mode == 3 && votes_invalid(fz, params)) {
      EXPECT_NE(st, BICO_OK) << "votes outside int32 were accepted";
    }
    if (st == BICO_OK) {
      bico_stfile *f = nullptr;
      ASSERT_EQ(bico_stfile_open(ctx, out.c_str(), &f), BICO_OK);
      for (size_t k = 0; k < bt::count(bico_stfile_count, f); k++)
        EXPECT_EQ(bico_stfile_check_finite(f, k), BICO_OK) << bico_ctx_errmsg(ctx);
      bico_stfile_free(f);
    } else {
      expect_clean_failure(ctx, st);
      EXPECT_FALSE(fs::exists(out));
    }
    for (auto &name : dir.list())
      EXPECT_EQ(name.find("bico-tmp"), std::string::npos) << name;
  }
}

}  // namespace
