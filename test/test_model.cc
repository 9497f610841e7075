// bico_model: grouping of tensors into modules, block detection, pairing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "testutil.h"

namespace {

struct Model {
  bico_model *m = nullptr;
  explicit Model(bico_ctx *ctx) { EXPECT_EQ(bico_model_create(ctx, &m), BICO_OK); }
  ~Model() { bico_model_free(m); }
  void add(const std::string &name, std::vector<size_t> shape, int dtype = 0) {
    ASSERT_EQ(bico_model_add_tensor(m, name.c_str(), dtype, shape.size(),
                                    shape.data()),
              BICO_OK)
        << name;
  }
  size_t module(const std::string &name) {
    size_t i = SIZE_MAX;
    EXPECT_EQ(bico_model_find_module(m, name.c_str(), &i), BICO_OK) << name;
    return i;
  }
  int kind(const std::string &name) {
    int k = 0;
    EXPECT_EQ(bico_model_module(m, module(name), nullptr, &k, nullptr, nullptr),
              BICO_OK);
    return k;
  }
  long block(const std::string &name) {
    long b = -2;
    EXPECT_EQ(bico_model_module(m, module(name), nullptr, nullptr, &b, nullptr),
              BICO_OK);
    return b;
  }
  int role(const std::string &tensor) {
    size_t i;
    EXPECT_EQ(bico_model_find_tensor(m, tensor.c_str(), &i), BICO_OK);
    int r = 0;
    EXPECT_EQ(bico_model_tensor_module(m, i, nullptr, &r), BICO_OK);
    return r;
  }
};

// A pre-norm ViT-shaped parameter list with `depth` blocks of width d.
void vit(Model &m, size_t depth, size_t d, size_t hidden) {
  m.add("cls_token", {1, 1, d});
  m.add("pos_embed", {1, 5, d});
  m.add("patch_embed.proj.weight", {d, 3, 2, 2});
  m.add("patch_embed.proj.bias", {d});
  for (size_t i = 0; i < depth; i++) {
    std::string b = "blocks." + std::to_string(i) + ".";
    m.add(b + "norm1.weight", {d});
    m.add(b + "norm1.bias", {d});
    m.add(b + "attn.qkv.weight", {3 * d, d});
    m.add(b + "attn.qkv.bias", {3 * d});
    m.add(b + "attn.proj.weight", {d, d});
    m.add(b + "attn.proj.bias", {d});
    m.add(b + "norm2.weight", {d});
    m.add(b + "norm2.bias", {d});
    m.add(b + "mlp.fc1.weight", {hidden, d});
    m.add(b + "mlp.fc1.bias", {hidden});
    m.add(b + "mlp.fc2.weight", {d, hidden});
    m.add(b + "mlp.fc2.bias", {d});
  }
  m.add("norm.weight", {d});
  m.add("norm.bias", {d});
  m.add("head.weight", {10, d});
  m.add("head.bias", {10});
}

TEST(ModelGroup, ModulesKindsRolesAndDims) {
  bt::Ctx ctx;
  Model m(ctx);
  vit(m, 3, 8, 32);
  m.add("blocks.0.attn.num_batches_tracked", {}, BICO_DTYPE_I64);
  m.add("embeddings.word_embeddings.weight", {100, 8});

  // 4 stem tensors + 12 per block + 4 + the two extras.
  EXPECT_EQ(bt::count(bico_model_tensor_count, m.m), 4u + 36u + 4u + 2u);
  // Modules: root, patch_embed.proj, 6 per block, norm, head, attn (holding
  // the counter), embeddings.word_embeddings.
  EXPECT_EQ(bt::count(bico_model_module_count, m.m), 2u + 18u + 2u + 1u + 1u);

  EXPECT_EQ(m.kind("patch_embed.proj"), BICO_MODULE_LINEAR);
  EXPECT_EQ(m.kind("blocks.1.attn.qkv"), BICO_MODULE_LINEAR);
  EXPECT_EQ(m.kind("blocks.1.norm1"), BICO_MODULE_ELEMENTWISE);
  EXPECT_EQ(m.kind("norm"), BICO_MODULE_ELEMENTWISE);
  EXPECT_EQ(m.kind(""), BICO_MODULE_OTHER);
  EXPECT_EQ(m.kind("embeddings.word_embeddings"), BICO_MODULE_EMBEDDING);
  EXPECT_EQ(m.kind("blocks.0.attn"), BICO_MODULE_OTHER);

  EXPECT_EQ(m.role("cls_token"), BICO_ROLE_TOKEN);
  EXPECT_EQ(m.role("pos_embed"), BICO_ROLE_TOKEN);
  EXPECT_EQ(m.role("patch_embed.proj.weight"), BICO_ROLE_WEIGHT);
  EXPECT_EQ(m.role("patch_embed.proj.bias"), BICO_ROLE_BIAS);
  EXPECT_EQ(m.role("blocks.2.mlp.fc1.bias"), BICO_ROLE_BIAS);
  EXPECT_EQ(m.role("blocks.2.norm2.weight"), BICO_ROLE_VECTOR);
  EXPECT_EQ(m.role("embeddings.word_embeddings.weight"), BICO_ROLE_TOKEN);
  EXPECT_EQ(m.role("blocks.0.attn.num_batches_tracked"), BICO_ROLE_OTHER);

  size_t dout, din;
  ASSERT_EQ(bico_model_module_dims(m.m, m.module("patch_embed.proj"), &dout, &din),
            BICO_OK);
  EXPECT_EQ(dout, 8u);
  EXPECT_EQ(din, 12u);  // a conv weight [8, 3, 2, 2] flattens to 12 inputs
  ASSERT_EQ(bico_model_module_dims(m.m, m.module("blocks.0.attn.qkv"), &dout, &din),
            BICO_OK);
  EXPECT_EQ(dout, 24u);
  EXPECT_EQ(din, 8u);
  EXPECT_EQ(bico_model_module_dims(m.m, m.module(""), &dout, &din), BICO_E_ARG);

  // The module's tensors are the ones whose names extend it.
  size_t fc1 = m.module("blocks.2.mlp.fc1"), n = 0;
  ASSERT_EQ(bico_model_module(m.m, fc1, nullptr, nullptr, nullptr, &n), BICO_OK);
  ASSERT_EQ(n, 2u);
  for (size_t k = 0; k < n; k++) {
    size_t t;
    const char *name;
    ASSERT_EQ(bico_model_module_tensor(m.m, fc1, k, &t), BICO_OK);
    ASSERT_EQ(bico_model_tensor(m.m, t, &name, nullptr, nullptr, nullptr), BICO_OK);
    EXPECT_EQ(std::string(name).rfind("blocks.2.mlp.fc1.", 0), 0u) << name;
  }
}

TEST(ModelBlocks, DetectsTheContainerWithMostTensors) {
  bt::Ctx ctx;
  Model m(ctx);
  vit(m, 4, 8, 16);
  // A second, smaller numbered container must not win.
  m.add("heads.0.weight", {2, 8});
  m.add("heads.1.weight", {2, 8});
  const char *prefix = nullptr;
  size_t count = 0;
  ASSERT_EQ(bico_model_blocks(m.m, &prefix, &count), BICO_OK);
  ASSERT_NE(prefix, nullptr);
  EXPECT_STREQ(prefix, "blocks");
  EXPECT_EQ(count, 4u);
  EXPECT_EQ(m.block("blocks.3.mlp.fc2"), 3);
  EXPECT_EQ(m.block("blocks.0.norm1"), 0);
  EXPECT_EQ(m.block("head"), -1);
  EXPECT_EQ(m.block("heads.1"), -1);

  // The override chooses the other container.
  ASSERT_EQ(bico_model_set_blocks(m.m, "heads"), BICO_OK);
  ASSERT_EQ(bico_model_blocks(m.m, &prefix, &count), BICO_OK);
  EXPECT_STREQ(prefix, "heads");
  EXPECT_EQ(count, 2u);
  EXPECT_EQ(m.block("heads.1"), 1);
  EXPECT_EQ(m.block("blocks.3.mlp.fc2"), -1);

  // A prefix nobody uses is reported by name.
  ASSERT_EQ(bico_model_set_blocks(m.m, "layers"), BICO_OK);
  EXPECT_EQ(bico_model_blocks(m.m, &prefix, &count), BICO_E_NOTFOUND);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("layers"), std::string::npos);
  ASSERT_EQ(bico_model_set_blocks(m.m, nullptr), BICO_OK);
  ASSERT_EQ(bico_model_blocks(m.m, &prefix, &count), BICO_OK);
  EXPECT_STREQ(prefix, "blocks");
}

TEST(ModelBlocks, NestedAndEmptyPrefixes) {
  bt::Ctx ctx;
  {
    // HF-style nesting: the encoder's layers hold more tensors than any
    // stage-local container.
    Model m(ctx);
    for (int i = 0; i < 3; i++)
      for (int h = 0; h < 2; h++)
        m.add("model.encoder.layer." + std::to_string(i) + ".attention.heads." +
                  std::to_string(h) + ".weight",
              {4, 4});
    const char *prefix;
    size_t count;
    ASSERT_EQ(bico_model_blocks(m.m, &prefix, &count), BICO_OK);
    EXPECT_STREQ(prefix, "model.encoder.layer");
    EXPECT_EQ(count, 3u);
  }
  {
    // nn.Sequential: names start with the index.
    Model m(ctx);
    m.add("0.weight", {4, 4});
    m.add("0.bias", {4});
    m.add("2.weight", {4, 4});
    const char *prefix;
    size_t count;
    ASSERT_EQ(bico_model_blocks(m.m, &prefix, &count), BICO_OK);
    ASSERT_NE(prefix, nullptr);
    EXPECT_STREQ(prefix, "");
    EXPECT_EQ(count, 3u);  // largest index + 1
    EXPECT_EQ(m.block("2"), 2);
  }
  {
    Model m(ctx);
    m.add("fc.weight", {4, 4});
    const char *prefix = "x";
    size_t count = 9;
    ASSERT_EQ(bico_model_blocks(m.m, &prefix, &count), BICO_OK);
    EXPECT_EQ(prefix, nullptr);
    EXPECT_EQ(count, 0u);
  }
}

// The depth formula, computed here: i(j) = round(j (la - 1) / (lb - 1)),
// halves up.
size_t depth_ref(size_t j, size_t la, size_t lb) {
  if (lb == 1) return 0;
  size_t num = j * (la - 1), den = lb - 1;
  return (2 * num + den) / (2 * den);
}

TEST(ModelPair, FourSourceBlocksPairWithSixTargetBlocksByDepth) {
  bt::Ctx ctx;
  Model a(ctx), b(ctx);
  vit(a, 4, 8, 16);
  vit(b, 6, 12, 24);
  const size_t expect[6] = {0, 1, 1, 2, 2, 3};
  for (size_t j = 0; j < 6; j++) {
    ASSERT_EQ(depth_ref(j, 4, 6), expect[j]);
    std::string t = "blocks." + std::to_string(j) + ".mlp.fc1";
    size_t sm;
    ASSERT_EQ(bico_model_pair_module(b.m, b.module(t), a.m, &sm), BICO_OK) << t;
    const char *name;
    ASSERT_EQ(bico_model_module(a.m, sm, &name, nullptr, nullptr, nullptr), BICO_OK);
    EXPECT_EQ(std::string(name), "blocks." + std::to_string(expect[j]) + ".mlp.fc1");

    size_t ti, si;
    std::string tn = t + ".bias";
    ASSERT_EQ(bico_model_find_tensor(b.m, tn.c_str(), &ti), BICO_OK);
    ASSERT_EQ(bico_model_pair_tensor(b.m, ti, a.m, &si), BICO_OK);
    ASSERT_EQ(bico_model_tensor(a.m, si, &name, nullptr, nullptr, nullptr), BICO_OK);
    EXPECT_EQ(std::string(name),
              "blocks." + std::to_string(expect[j]) + ".mlp.fc1.bias");

    // Calibration keys map the same way.
    char buf[128];
    size_t len;
    ASSERT_EQ(bico_model_map_name(b.m, a.m, (t + ".output_grad").c_str(), buf,
                                  sizeof buf, &len),
              BICO_OK);
    EXPECT_EQ(std::string(buf), "blocks." + std::to_string(expect[j]) +
                                    ".mlp.fc1.output_grad");
    EXPECT_EQ(len, strlen(buf));
  }
  // Outside the blocks: by identical name.
  size_t sm;
  ASSERT_EQ(bico_model_pair_module(b.m, b.module("head"), a.m, &sm), BICO_OK);
  EXPECT_EQ(sm, a.module("head"));
  ASSERT_EQ(bico_model_pair_module(b.m, b.module(""), a.m, &sm), BICO_OK);
  EXPECT_EQ(sm, a.module(""));
}

TEST(ModelPair, ManyDepthsMatchTheFormulaAndDifferentContainers) {
  bt::Ctx ctx;
  for (size_t la : {1, 2, 5, 12})
    for (size_t lb : {1, 3, 7, 24}) {
      Model a(ctx), b(ctx);
      for (size_t i = 0; i < la; i++)
        a.add("layers." + std::to_string(i) + ".fc.weight", {4, 4});
      for (size_t j = 0; j < lb; j++)
        b.add("h." + std::to_string(j) + ".fc.weight", {4, 4});
      for (size_t j = 0; j < lb; j++) {
        size_t sm;
        ASSERT_EQ(bico_model_pair_module(
                      b.m, b.module("h." + std::to_string(j) + ".fc"), a.m, &sm),
                  BICO_OK);
        EXPECT_EQ(sm, a.module("layers." + std::to_string(depth_ref(j, la, lb)) +
                               ".fc"))
            << la << " " << lb << " " << j;
      }
    }
}

TEST(ModelErrors, BadInputIsRefusedWithAMessage) {
  bt::Ctx ctx;
  Model m(ctx);
  size_t shape[2] = {2, 3};
  m.add("a.weight", {2, 3});
  EXPECT_EQ(bico_model_add_tensor(m.m, "a.weight", 0, 2, shape), BICO_E_ARG);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("a.weight"), std::string::npos);
  EXPECT_EQ(bico_model_add_tensor(m.m, "", 0, 2, shape), BICO_E_ARG);
  EXPECT_EQ(bico_model_add_tensor(m.m, nullptr, 0, 2, shape), BICO_E_NULL);
  EXPECT_EQ(bico_model_add_tensor(m.m, "b", 0, 2, nullptr), BICO_E_NULL);
  EXPECT_EQ(bico_model_add_tensor(m.m, "b", 99, 2, shape), BICO_E_ARG);
  EXPECT_EQ(bico_model_add_tensor(nullptr, "b", 0, 2, shape), BICO_E_NULL);
  EXPECT_EQ(bico_model_create(ctx, nullptr), BICO_E_NULL);
  bico_model *none = reinterpret_cast<bico_model *>(&shape);
  EXPECT_EQ(bico_model_create(nullptr, &none), BICO_E_NULL);
  EXPECT_EQ(none, nullptr);

  size_t i;
  EXPECT_EQ(bico_model_find_tensor(m.m, "zz", &i), BICO_E_NOTFOUND);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("zz"), std::string::npos);
  EXPECT_EQ(bico_model_find_module(m.m, "zz", &i), BICO_E_NOTFOUND);
  EXPECT_EQ(bico_model_tensor(m.m, 5, nullptr, nullptr, nullptr, nullptr), BICO_E_ARG);
  EXPECT_EQ(bico_model_module(m.m, 5, nullptr, nullptr, nullptr, nullptr), BICO_E_ARG);

  // A target module the source lacks: NOTFOUND naming both names.
  Model src(ctx);
  src.add("b.weight", {2, 3});
  ASSERT_EQ(bico_model_find_tensor(m.m, "a.weight", &i), BICO_OK);
  size_t si;
  EXPECT_EQ(bico_model_pair_tensor(m.m, i, src.m, &si), BICO_E_NOTFOUND);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("a.weight"), std::string::npos);

  // Target blocks but a source without: NOTFOUND.
  Model tb(ctx);
  tb.add("blocks.0.fc.weight", {2, 2});
  char buf[8];
  EXPECT_EQ(bico_model_map_name(tb.m, src.m, "blocks.0.fc", buf, sizeof buf, nullptr),
            BICO_E_NOTFOUND);
  // A buffer too small.
  EXPECT_EQ(bico_model_map_name(m.m, src.m, "a.very.long.name", buf, sizeof buf,
                                nullptr),
            BICO_E_ARG);
  bico_model_free(nullptr);
}

}  // namespace
