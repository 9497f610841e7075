// Decoder families and the structure-aware switch, through the public API:
// options, names, config.json errors (file and field named, nothing
// written), and a one-layer decoder whose target is the source with its
// heads permuted and each head pair rotated inside RoPE's frequency pairs:
// the structured run recovers the planted update (independent reference
// algebra from testutil), with the SwiGLU units permuted as well.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#include "testutil.h"
#include "transfer_testutil.h"

namespace {

using bt::Mat;

void put(const std::string &path, const std::string &text) {
  std::ofstream f(path);
  f << text;
}

// One decoder layer: d = 8, 2 query heads sharing 1 key/value head of
// head_dim 4 (RoPE pairs (0,2) and (1,3)), SwiGLU width 6.
const size_t D = 8, HD = 4, H = 2, KV = 1, F = 6, N = 64;
const char *const PROJ[7] = {"q_proj", "k_proj", "v_proj", "o_proj",
                             "gate_proj", "up_proj", "down_proj"};

std::string mod(int k) {
  return std::string("model.layers.0.") + (k < 4 ? "self_attn." : "mlp.") + PROJ[k];
}

// Rows x cols of projection k.
void shape(int k, size_t *r, size_t *c) {
  const size_t out[7] = {H * HD, KV * HD, KV * HD, D, F, F, D};
  const size_t in[7] = {D, D, D, H * HD, D, D, F};
  *r = out[k];
  *c = in[k];
}

// A rotation commuting with half-split RoPE on head_dim 4.
Mat rope_rot(bt::Rng &g) {
  Mat R(HD, HD);
  for (size_t p = 0; p < HD / 2; p++) {
    double a = 6.283185307179586 * g.uniform();
    size_t i = p, j = p + HD / 2;
    R(i, i) = std::cos(a);
    R(i, j) = -std::sin(a);
    R(j, i) = std::sin(a);
    R(j, j) = std::cos(a);
  }
  return R;
}

// Block-diagonal of `blocks` copies of M placed by the permutation perm
// (new block b <- old block perm[b]).
Mat blockperm(const Mat &M, const std::vector<size_t> &perm) {
  size_t b = M.r, n = perm.size();
  Mat out(n * b, n * b);
  for (size_t x = 0; x < n; x++)
    for (size_t i = 0; i < b; i++)
      for (size_t j = 0; j < b; j++) out(x * b + i, perm[x] * b + j) = M(i, j);
  return out;
}

void collect(void *opaque, const char *line) {
  *static_cast<std::string *>(opaque) += std::string(line) + "\n";
}

struct Layer {
  std::string dir, log;
  Mat Q, K, V, O, Fm, P;  // new = M @ old per space
  std::vector<Mat> tauA;
  Layer() {
    char tmpl[] = "/tmp/bico_family_XXXXXX";
    dir = mkdtemp(tmpl);
    mkdir((dir + "/A").c_str(), 0755);
    mkdir((dir + "/B").c_str(), 0755);
    bt::Rng g(7);
    Mat rot = rope_rot(g), vm = bt::rand_orth(g, HD);
    Q = blockperm(rot, {1, 0});  // the two query heads swap
    K = rot;
    V = vm;
    O = blockperm(vm, {1, 0});
    Fm = bt::rand_perm(g, F);
    P = bt::rand_perm(g, D);
    // Maps of each projection's output (rows) and input (columns).
    const Mat *outm[7] = {&Q, &K, &V, &P, &Fm, &Fm, &P};
    const Mat *inm[7] = {&P, &P, &P, &O, &P, &P, &Fm};
    std::vector<std::pair<std::string, Mat>> wa, wb, cal_a, cal_b, tau;
    for (int k = 0; k < 7; k++) {
      size_t r, c;
      shape(k, &r, &c);
      Mat W = bt::randn(g, r, c, 0.5), t = bt::randn(g, r, c, 0.1);
      tauA.push_back(t);
      wa.push_back({mod(k) + ".weight", W});
      wb.push_back({mod(k) + ".weight",
                    bt::matmul(bt::matmul(*outm[k], W), bt::transpose(*inm[k]))});
      tau.push_back({mod(k) + ".weight", t});
      // Generic rows; the target's are the same rows in its coordinates.
      Mat X = bt::randn(g, N, c), G = bt::randn(g, N, r);
      cal_a.push_back({mod(k) + ".input", X});
      cal_a.push_back({mod(k) + ".output_grad", G});
      cal_b.push_back({mod(k) + ".input", bt::matmul(X, bt::transpose(*inm[k]))});
      cal_b.push_back({mod(k) + ".output_grad", bt::matmul(G, bt::transpose(*outm[k]))});
    }
    ttu::write_mats(dir + "/A/model.safetensors", wa);
    ttu::write_mats(dir + "/B/model.safetensors", wb);
    ttu::write_mats(dir + "/tau.safetensors", tau);
    ttu::write_mats(dir + "/calA.safetensors", cal_a);
    ttu::write_mats(dir + "/calB.safetensors", cal_b);
    std::string cfg =
        "{\"model_type\": \"llama\", \"hidden_size\": 8, \"intermediate_size\": 6, "
        "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
        "\"num_key_value_heads\": 1, \"tie_word_embeddings\": false}";
    put(dir + "/A/config.json", cfg);
    put(dir + "/B/config.json", cfg);
  }
  ~Layer() {
    const char *files[] = {"/A/model.safetensors", "/B/model.safetensors",
                           "/A/config.json", "/B/config.json", "/tau.safetensors",
                           "/calA.safetensors", "/calB.safetensors",
                           "/out.safetensors", "/delta.safetensors", "/bad.json"};
    for (const char *f : files) unlink((dir + f).c_str());
    rmdir((dir + "/A").c_str());
    rmdir((dir + "/B").c_str());
    rmdir(dir.c_str());
  }
  bico_status run(bico_ctx *ctx, int structure, const char *target_config = nullptr) {
    bico_transfer *t = nullptr;
    bico_status st = bico_transfer_create(ctx, &t);
    std::string a = dir + "/A", b = dir + "/B", tv = dir + "/tau.safetensors",
                ca = dir + "/calA.safetensors", cb = dir + "/calB.safetensors",
                o = dir + "/out.safetensors", d = dir + "/delta.safetensors";
    const std::pair<int, const std::string *> fs[] = {
        {BICO_FILE_SOURCE_BASE, &a}, {BICO_FILE_TARGET_BASE, &b},
        {BICO_FILE_TASK_VECTOR, &tv}, {BICO_FILE_SOURCE_CALIB, &ca},
        {BICO_FILE_TARGET_CALIB, &cb}, {BICO_FILE_OUTPUT, &o},
        {BICO_FILE_DELTA_OUTPUT, &d}};
    for (auto &f : fs)
      if (st == BICO_OK) st = bico_transfer_set_file(t, f.first, f.second->c_str());
    if (st == BICO_OK && target_config)
      st = bico_transfer_set_file(t, BICO_FILE_TARGET_CONFIG, target_config);
    if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_STRUCTURE, structure);
    log.clear();
    if (st == BICO_OK) st = bico_transfer_set_log(t, collect, &log);
    if (st == BICO_OK) st = bico_transfer_run(t);
    bico_transfer_free(t);
    return st;
  }
};

TEST(Family, OptionsAndNames) {
  bt::Ctx ctx;
  bico_transfer *t = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  double v = -1, lo, hi;
  EXPECT_EQ(bico_transfer_get_param(t, BICO_TRANSFER_STRUCTURE, &v), BICO_OK);
  EXPECT_EQ(v, BICO_STRUCTURE_FREE);
  for (int p : {BICO_TRANSFER_ROPE, BICO_TRANSFER_HEADS, BICO_TRANSFER_KV_HEADS,
                BICO_TRANSFER_HEAD_DIM}) {
    EXPECT_EQ(bico_transfer_get_param(t, p, &v), BICO_OK);
    EXPECT_EQ(v, 0) << p;
    unsigned flags = 0;
    EXPECT_EQ(bico_transfer_param_bounds(p, &lo, &hi, &flags), BICO_OK);
    EXPECT_TRUE(flags & BICO_PARAM_INTEGER);
    EXPECT_EQ(lo, 0);
    EXPECT_EQ(bico_transfer_set_param(t, p, 1.5), BICO_E_ARG) << p;
    EXPECT_EQ(bico_transfer_set_param(t, p, -1), BICO_E_ARG) << p;
  }
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_STRUCTURE, 3), BICO_E_ARG);
  // 0 is the default member (docs/api.md): get_param reports it resolved.
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_STRUCTURE, BICO_STRUCTURE_HEADS), BICO_OK);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_STRUCTURE, 0), BICO_OK);
  EXPECT_EQ(bico_transfer_get_param(t, BICO_TRANSFER_STRUCTURE, &v), BICO_OK);
  EXPECT_EQ(v, BICO_STRUCTURE_FREE);
  int key = 0;
  EXPECT_EQ(bico_transfer_param_from_name("kv_heads", &key), BICO_OK);
  EXPECT_EQ(key, BICO_TRANSFER_KV_HEADS);
  EXPECT_STREQ(bico_transfer_param_name(BICO_TRANSFER_ROPE), "rope");
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ROPE, BICO_ROPE_NONE + 1), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ROPE, BICO_ROPE_INTERLEAVED), BICO_OK);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_HEADS, 32), BICO_OK);
  EXPECT_EQ(bico_transfer_set_file(t, BICO_FILE_SOURCE_CONFIG, "c.json"), BICO_OK);
  EXPECT_EQ(bico_transfer_set_file(t, BICO_FILE_TARGET_CONFIG, "d.json"), BICO_OK);
  EXPECT_EQ(bico_transfer_set_file(t, BICO_FILE_BRIDGE_OUTPUT + 1, "e.json"), BICO_E_ARG);
  bico_transfer_free(t);
  int x = -1;
  EXPECT_STREQ(bico_transfer_structure_name(BICO_STRUCTURE_FREE), "free");
  EXPECT_STREQ(bico_transfer_structure_name(BICO_STRUCTURE_HEADS), "heads");
  EXPECT_EQ(bico_transfer_structure_name(0), nullptr);
  EXPECT_EQ(bico_transfer_structure_name(3), nullptr);
  EXPECT_EQ(bico_transfer_structure_from_name("heads", &x), BICO_OK);
  EXPECT_EQ(x, BICO_STRUCTURE_HEADS);
  EXPECT_EQ(bico_transfer_structure_from_name("rows", &x), BICO_E_NOTFOUND);
  EXPECT_EQ(bico_transfer_structure_from_name(nullptr, &x), BICO_E_NULL);
  const char *ropes[4] = {nullptr, "half", "interleaved", "none"};
  for (int r = 1; r < 4; r++) {
    EXPECT_STREQ(bico_transfer_rope_name(r), ropes[r]);
    EXPECT_EQ(bico_transfer_rope_from_name(ropes[r], &x), BICO_OK);
    EXPECT_EQ(x, r);
  }
  EXPECT_EQ(bico_transfer_rope_name(0), nullptr);
  EXPECT_EQ(bico_transfer_rope_name(4), nullptr);
  EXPECT_EQ(bico_transfer_rope_name(-1), nullptr);
  EXPECT_EQ(bico_transfer_rope_from_name("spiral", &x), BICO_E_NOTFOUND);
}

TEST(Family, PlantedLayerRecoveredWithStructure) {
  Layer L;
  bt::Ctx ctx;
  ASSERT_EQ(L.run(ctx, BICO_STRUCTURE_HEADS), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_NE(L.log.find("structure-aware maps; source llama (2 heads, 1 key/value, "
                       "head_dim 4, rope half)"),
            std::string::npos)
      << L.log;
  const Mat *outm[7] = {&L.Q, &L.K, &L.V, &L.P, &L.Fm, &L.Fm, &L.P};
  const Mat *inm[7] = {&L.P, &L.P, &L.P, &L.O, &L.P, &L.P, &L.Fm};
  for (int k = 0; k < 7; k++) {
    size_t r, c;
    shape(k, &r, &c);
    Mat want = bt::matmul(bt::matmul(*outm[k], L.tauA[k]), bt::transpose(*inm[k]));
    Mat got = ttu::read_mat(L.dir + "/delta.safetensors", mod(k) + ".weight", r, c);
    EXPECT_LT(bt::relerr(got, want), 1e-4) << mod(k);
  }
}

TEST(Family, BadConfigNamesFileAndFieldAndWritesNothing) {
  Layer L;
  bt::Ctx ctx;
  struct Case {
    const char *json, *field;
  } cases[] = {
      {"{\"model_type\": \"llama\", \"hidden_size\": 8, \"num_hidden_layers\": 1, "
       "\"num_attention_heads\": 2}", "intermediate_size"},
      {"{\"model_type\": \"mistral\", \"hidden_size\": 8, \"intermediate_size\": 6, "
       "\"num_hidden_layers\": 1, \"num_attention_heads\": 3}", "hidden_size"},
      {"{\"model_type\": \"qwen2\", \"hidden_size\": 8, \"intermediate_size\": 6, "
       "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
       "\"num_key_value_heads\": -1}", "num_key_value_heads"},
      {"{\"model_type\": \"llama\", \"hidden_size\": 8, \"intermediate_size\": 6, "
       "\"num_hidden_layers\": 1, \"num_attention_heads\": 4}", "num_key_value_heads"},
      {"{\"model_type\": \"llama\",", "invalid JSON"},
      // issue 22: products of counts past 2^40 (here 2^64 + 32, wrapping
      // onto a small width) describe no tensor.
      {"{\"model_type\": \"llama\", \"hidden_size\": 8, \"intermediate_size\": 6, "
       "\"num_hidden_layers\": 1, \"num_attention_heads\": 87586849968, "
       "\"num_key_value_heads\": 87586849968, \"head_dim\": 210610886}",
       "num_attention_heads 87586849968 x head_dim 210610886 is above 2^40"},
      {"{\"model_type\": \"llama\", \"hidden_size\": 1099511627776, "
       "\"intermediate_size\": 1099511627776, \"num_hidden_layers\": 1, "
       "\"num_attention_heads\": 1}", "hidden_size 1099511627776 x intermediate_size"},
  };
  std::string bad = L.dir + "/bad.json", out = L.dir + "/out.safetensors";
  for (auto &c : cases) {
    put(bad, c.json);
    unlink(out.c_str());
    bico_status st = L.run(ctx, BICO_STRUCTURE_HEADS, bad.c_str());
    EXPECT_TRUE(st == BICO_E_FORMAT || st == BICO_E_SHAPE) << c.field << " " << st;
    std::string msg = bico_ctx_errmsg(ctx);
    EXPECT_NE(msg.find(bad), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.field), std::string::npos) << msg;
    EXPECT_NE(access(out.c_str(), F_OK), 0) << c.field;
    // Free-form maps do not need the attention geometry; a config that is
    // not JSON is malformed whatever reads it (it decides the naming too).
    if (std::string(c.field) == "invalid JSON") {
      EXPECT_EQ(L.run(ctx, BICO_STRUCTURE_FREE, bad.c_str()), BICO_E_FORMAT);
      EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find(bad), std::string::npos)
          << bico_ctx_errmsg(ctx);
    } else {
      EXPECT_EQ(L.run(ctx, BICO_STRUCTURE_FREE, bad.c_str()), BICO_OK)
          << bico_ctx_errmsg(ctx);
    }
  }
  // An unknown model_type is no family: free-form, no error.
  put(bad, "{\"model_type\": \"bert\"}");
  EXPECT_EQ(L.run(ctx, BICO_STRUCTURE_HEADS, bad.c_str()), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_NE(L.log.find("free-form maps (no known decoder family in the target's"),
            std::string::npos)
      << L.log;
}

}  // namespace
