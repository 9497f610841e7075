// bico_transfer_explain: the plan's decisions through the C API, on
// checkpoints composed here (GPT-2 names, no config.json), and its misuse.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "bico/bico.h"
#include "st_testutil.h"

namespace {

using Shape = std::vector<size_t>;

// A safetensors file of F32 zeros with these names and shapes.
std::string zeros_file(const std::vector<std::pair<std::string, Shape>> &ts) {
  std::string h = "{", data;
  size_t off = 0;
  for (size_t i = 0; i < ts.size(); i++) {
    size_t n = 1;
    std::string sh;
    for (size_t d = 0; d < ts[i].second.size(); d++) {
      n *= ts[i].second[d];
      sh += (d ? "," : "") + std::to_string(ts[i].second[d]);
    }
    h += (i ? "," : "") + std::string("\"") + ts[i].first +
         "\":{\"dtype\":\"F32\",\"shape\":[" + sh + "],\"data_offsets\":[" +
         std::to_string(off) + "," + std::to_string(off + 4 * n) + "]}";
    data += std::string(4 * n, '\0');
    off += 4 * n;
  }
  return stt::st_bytes(h + "}", data);
}

std::vector<std::pair<std::string, Shape>> gpt2_names(size_t d, size_t layers) {
  std::vector<std::pair<std::string, Shape>> v = {{"wte.weight", {10, d}},
                                                  {"wpe.weight", {6, d}}};
  for (size_t i = 0; i < layers; i++) {
    std::string p = "h." + std::to_string(i) + ".";
    v.push_back({p + "ln_1.weight", {d}});
    v.push_back({p + "attn.bias", {1, 1, 6, 6}});  // old checkpoints' mask
    v.push_back({p + "attn.c_attn.weight", {d, 3 * d}});
    v.push_back({p + "attn.c_attn.bias", {3 * d}});
    v.push_back({p + "attn.c_proj.weight", {d, d}});
    v.push_back({p + "mlp.c_fc.weight", {d, 4 * d}});
    v.push_back({p + "mlp.c_proj.weight", {4 * d, d}});
  }
  v.push_back({"ln_f.weight", {d}});
  return v;
}

struct Handles {
  bico_ctx *ctx = nullptr;
  bico_transfer *t = nullptr;
  Handles() {
    bico_ctx_create(&ctx);
    bico_transfer_create(ctx, &t);
  }
  ~Handles() {
    bico_transfer_free(t);
    bico_ctx_free(ctx);
  }
};

const bico_transfer_decision *find(const std::vector<bico_transfer_decision> &v,
                                   const std::string &name) {
  for (auto &d : v)
    if (name == d.name) return &d;
  return nullptr;
}

}  // namespace

TEST(TransferExplain, QueriesBeforeAnExplainAreStateErrors) {
  Handles h;
  size_t n = 7;
  EXPECT_EQ(bico_transfer_explain_count(h.t, &n), BICO_E_STATE);
  EXPECT_EQ(n, 7u);
  // The count's form (docs/api.md): NULL handle or n is BICO_E_NULL.
  EXPECT_EQ(bico_transfer_explain_count(nullptr, &n), BICO_E_NULL);
  EXPECT_EQ(n, 7u);
  EXPECT_EQ(bico_transfer_explain_count(h.t, nullptr), BICO_E_NULL);
  EXPECT_NE(std::string(bico_ctx_errmsg(h.ctx)).find(
                "transfer_explain_count: n is NULL"),
            std::string::npos)
      << bico_ctx_errmsg(h.ctx);
  bico_transfer_decision d;
  d.size = sizeof d;
  EXPECT_EQ(bico_transfer_explain_tensor(h.t, 0, &d), BICO_E_STATE);
  bico_transfer_model_info m;
  m.size = sizeof m;
  EXPECT_EQ(bico_transfer_explain_model(h.t, 0, &m), BICO_E_STATE);
  EXPECT_EQ(bico_transfer_explain_vocab(h.t, &n, nullptr, nullptr, nullptr),
            BICO_E_STATE);
  EXPECT_EQ(bico_transfer_explain(nullptr), BICO_E_NULL);
  // Without both bases there is nothing to explain.
  EXPECT_EQ(bico_transfer_explain(h.t), BICO_E_ARG);
  EXPECT_NE(std::string(bico_ctx_errmsg(h.ctx)).find("target base"),
            std::string::npos);
  EXPECT_EQ(bico_transfer_explain_count(h.t, &n), BICO_E_STATE);
}

TEST(TransferExplain, Gpt2NamesDecideLayoutSplitAndBuffers) {
  stt::TempDir dir;
  stt::write_bytes(dir / "a.safetensors", zeros_file(gpt2_names(4, 2)));
  stt::write_bytes(dir / "b.safetensors", zeros_file(gpt2_names(8, 3)));
  Handles h;
  ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_SOURCE_BASE,
                                   (dir / "a.safetensors").c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_TARGET_BASE,
                                   (dir / "b.safetensors").c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_explain(h.t), BICO_OK) << bico_ctx_errmsg(h.ctx);
  bico_transfer_model_info m;
  m.size = sizeof m;
  ASSERT_EQ(bico_transfer_explain_model(h.t, 1, &m), BICO_OK);
  EXPECT_STREQ(m.family, "gpt2");
  EXPECT_NE(std::string(m.family_from).find("tensor names (h.0.attn.c_attn"),
            std::string::npos);
  EXPECT_STREQ(m.blocks, "h");
  EXPECT_EQ(m.nblocks, 3u);
  EXPECT_EQ(m.tensors, gpt2_names(8, 3).size());
  EXPECT_EQ(bico_transfer_explain_model(h.t, 2, &m), BICO_E_ARG);
  size_t n = 0;
  ASSERT_EQ(bico_transfer_explain_count(h.t, &n), BICO_OK);
  ASSERT_EQ(n, gpt2_names(8, 3).size());
  std::vector<bico_transfer_decision> ds(n);
  for (size_t i = 0; i < n; i++) {
    ds[i].size = sizeof ds[i];
    ASSERT_EQ(bico_transfer_explain_tensor(h.t, i, &ds[i]), BICO_OK);
  }
  // Target block 1 of 3 pairs with source block round(1 * 1 / 2) = 1.
  const bico_transfer_decision *c = find(ds, "h.1.attn.c_attn.weight");
  ASSERT_NE(c, nullptr);
  EXPECT_STREQ(c->source, "h.1.attn.c_attn.weight");
  EXPECT_EQ(c->role, BICO_ROLE_WEIGHT);
  EXPECT_EQ(c->handling, BICO_HANDLING_LINEAR);
  EXPECT_EQ(c->transposed, 1);
  EXPECT_EQ(c->in_map, 1);
  EXPECT_EQ(c->out_maps, 3);
  const bico_transfer_decision *b = find(ds, "h.1.attn.c_attn.bias");
  EXPECT_EQ(b->role, BICO_ROLE_BIAS);  // 3d elements: the logical d_out
  EXPECT_EQ(b->transposed, 0);
  EXPECT_EQ(b->out_maps, 3);
  EXPECT_EQ(find(ds, "h.1.mlp.c_fc.weight")->out_maps, 1);
  const bico_transfer_decision *mask = find(ds, "h.0.attn.bias");
  EXPECT_EQ(mask->role, BICO_ROLE_OTHER);
  EXPECT_EQ(mask->handling, BICO_HANDLING_UNCHANGED);
  EXPECT_NE(std::string(mask->rule).find("buffer"), std::string::npos);
  const bico_transfer_decision *wte = find(ds, "wte.weight");
  EXPECT_EQ(wte->handling, BICO_HANDLING_TIED);
  EXPECT_STREQ(wte->module, "h.0.ln_1");
  // No tokenizer.json: no vocabulary map.
  size_t v[4] = {9, 9, 9, 9};
  EXPECT_EQ(bico_transfer_explain_vocab(h.t, &v[0], &v[1], &v[2], &v[3]),
            BICO_OK);
  EXPECT_EQ(v[0] + v[1] + v[2] + v[3], 0u);
  // Out of range, and the size convention: a smaller struct gets only the
  // fields it covers; a size below the size field itself is refused.
  EXPECT_EQ(bico_transfer_explain_tensor(h.t, n, &ds[0]), BICO_E_ARG);
  bico_transfer_decision small;
  small.size = offsetof(bico_transfer_decision, source);
  small.source = "untouched";
  ASSERT_EQ(bico_transfer_explain_tensor(h.t, 0, &small), BICO_OK);
  EXPECT_STREQ(small.name, "wte.weight");
  EXPECT_STREQ(small.source, "untouched");
  small.size = 0;
  EXPECT_EQ(bico_transfer_explain_tensor(h.t, 0, &small), BICO_E_ARG);
}

TEST(TransferExplain, UserSplitOverridesTheFamilyDefault) {
  stt::TempDir dir;
  stt::write_bytes(dir / "a.safetensors", zeros_file(gpt2_names(4, 1)));
  Handles h;
  ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_SOURCE_BASE,
                                   (dir / "a.safetensors").c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_TARGET_BASE,
                                   (dir / "a.safetensors").c_str()), BICO_OK);
  ASSERT_EQ(bico_transfer_add_split(h.t, "c_attn", 2), BICO_OK);
  ASSERT_EQ(bico_transfer_explain(h.t), BICO_OK) << bico_ctx_errmsg(h.ctx);
  size_t n = 0, i = 0;
  bico_transfer_explain_count(h.t, &n);
  bico_transfer_decision d;
  for (; i < n; i++) {
    d.size = sizeof d;
    bico_transfer_explain_tensor(h.t, i, &d);
    if (std::string(d.name) == "h.0.attn.c_attn.weight") break;
  }
  ASSERT_LT(i, n);
  EXPECT_EQ(d.out_maps, 2);
  EXPECT_NE(std::string(d.rule).find("--split"), std::string::npos);
}

// One reader of config.json: the naming family honours --source-config /
// --target-config as the attention geometry does, and a config given but
// malformed is an error naming the file and the reason, whatever reads it.
TEST(TransferExplain, GivenConfigDecidesNamingAndMalformedOneFails) {
  stt::TempDir dir;
  stt::write_bytes(dir / "a.safetensors", zeros_file(gpt2_names(4, 2)));
  stt::write_bytes(dir / "b.safetensors", zeros_file(gpt2_names(8, 3)));
  stt::write_bytes(dir / "src.json", "{\"model_type\": \"gpt2\"}");
  {
    Handles h;
    ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_SOURCE_BASE,
                                     (dir / "a.safetensors").c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_TARGET_BASE,
                                     (dir / "b.safetensors").c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_SOURCE_CONFIG,
                                     (dir / "src.json").c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_explain(h.t), BICO_OK) << bico_ctx_errmsg(h.ctx);
    bico_transfer_model_info m;
    m.size = sizeof m;
    ASSERT_EQ(bico_transfer_explain_model(h.t, 0, &m), BICO_OK);
    EXPECT_STREQ(m.family, "gpt2");
    EXPECT_STREQ(m.family_from, "config.json model_type \"gpt2\"");
    m.size = sizeof m;
    ASSERT_EQ(bico_transfer_explain_model(h.t, 1, &m), BICO_OK);
    EXPECT_STREQ(m.family, "gpt2");  // no config: its names decide
    EXPECT_NE(std::string(m.family_from).find("tensor names ("),
              std::string::npos);
  }
  const std::pair<const char *, const char *> bad[] = {
      {"{\"model_type\": ", "bad.json"},
      {"{\"model_type\": 7}", "model_type is not a string"},
      {"[1, 2]", "not a JSON object"}};
  for (auto &b : bad) {
    stt::write_bytes(dir / "bad.json", b.first);
    Handles h;
    ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_SOURCE_BASE,
                                     (dir / "a.safetensors").c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_TARGET_BASE,
                                     (dir / "b.safetensors").c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_TARGET_CONFIG,
                                     (dir / "bad.json").c_str()), BICO_OK);
    EXPECT_EQ(bico_transfer_explain(h.t), BICO_E_FORMAT) << b.first;
    std::string msg = bico_ctx_errmsg(h.ctx);
    EXPECT_NE(msg.find(dir / "bad.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find(b.second), std::string::npos) << msg;
  }
}

// model_type / causal_lm / causal_from (the fields bico transfer reads to
// require --alpha on a causal-LM target): from BICO_FILE_TARGET_CONFIG,
// "architectures" before model_type; none without a config.json; a struct
// sized before these fields gets the older fields only.
TEST(TransferExplain, CausalLmFromConfigJson) {
  stt::TempDir dir;
  stt::write_bytes(dir / "a.safetensors", zeros_file(gpt2_names(4, 2)));
  stt::write_bytes(dir / "b.safetensors", zeros_file(gpt2_names(8, 3)));
  stt::write_bytes(dir / "lm.json",
                   "{\"model_type\": \"mylm\", \"architectures\": "
                   "[\"MyBackbone\", \"MyLMForCausalLM\"]}");
  stt::write_bytes(dir / "llama.json", "{\"model_type\": \"llama\", "
                   "\"hidden_size\": 8, \"num_attention_heads\": 2, "
                   "\"num_hidden_layers\": 3, \"intermediate_size\": 32}");
  stt::write_bytes(dir / "vit.json", "{\"model_type\": \"vit\", "
                   "\"architectures\": [\"ViTForImageClassification\"]}");
  struct Case {
    const char *cfg, *type;
    int causal;
    const char *why;
  } cases[] = {{nullptr, "", 0, ""},
               {"lm.json", "mylm", 1, "architectures \"MyLMForCausalLM\""},
               {"llama.json", "llama", 1, "model_type \"llama\""},
               {"vit.json", "vit", 0, ""}};
  for (const Case &c : cases) {
    Handles h;
    ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_SOURCE_BASE,
                                     (dir / "a.safetensors").c_str()), BICO_OK);
    ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_TARGET_BASE,
                                     (dir / "b.safetensors").c_str()), BICO_OK);
    if (c.cfg) {
      ASSERT_EQ(bico_transfer_set_file(h.t, BICO_FILE_TARGET_CONFIG,
                                       (dir / c.cfg).c_str()), BICO_OK);
    }
    ASSERT_EQ(bico_transfer_explain(h.t), BICO_OK) << bico_ctx_errmsg(h.ctx);
    bico_transfer_model_info m;
    m.size = sizeof m;
    ASSERT_EQ(bico_transfer_explain_model(h.t, 1, &m), BICO_OK);
    EXPECT_STREQ(m.model_type, c.type) << (c.cfg ? c.cfg : "none");
    EXPECT_EQ(m.causal_lm, c.causal) << (c.cfg ? c.cfg : "none");
    std::string why(m.causal_from);
    if (c.causal) {
      EXPECT_NE(why.find((dir / c.cfg) + ": " + c.why), std::string::npos)
          << why;
    } else {
      EXPECT_EQ(why, "");
    }
    ASSERT_EQ(bico_transfer_explain_model(h.t, 0, &m), BICO_OK);
    EXPECT_EQ(m.causal_lm, 0);  // the source has no config.json
    // A caller built before these fields: they are left as the caller set
    // them.
    bico_transfer_model_info old;
    old.model_type = "unset";
    old.size = offsetof(bico_transfer_model_info, model_type);
    ASSERT_EQ(bico_transfer_explain_model(h.t, 1, &old), BICO_OK);
    EXPECT_STREQ(old.model_type, "unset");
    EXPECT_EQ(old.tensors, gpt2_names(8, 3).size());
  }
}
