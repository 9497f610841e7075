/* GPT-2 and CLIP: what their names and config.json say about layout,
 * roles, splits and containers (see family_names.h).  Detection reads a
 * model folder's config.json when there is one, else looks at the names;
 * the rules are keyed on name components so that a prefix ("transformer."
 * or none) changes nothing. */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "family_names.h"
#include "fileio.h"
#include "json.h"

const char *bico__family_name(int family) {
  switch (family) {
    case BICO__FAMILY_GPT2: return "gpt2";
    case BICO__FAMILY_CLIP: return "clip";
    default: return "none";
  }
}

static const char *last_component(const char *s, size_t len) {
  for (size_t i = len; i-- > 0;)
    if (s[i] == '.') return s + i + 1;
  return s;
}

/* The component of `name` before its last one (its module's last
 * component), into buf; "" when there is none. */
static void module_tail(const char *name, char *buf, size_t cap) {
  const char *dot = strrchr(name, '.');
  buf[0] = '\0';
  if (dot == NULL) return;
  size_t mlen = (size_t)(dot - name);
  const char *c = last_component(name, mlen);
  size_t n = (size_t)(name + mlen - c);
  if (n >= cap) return;
  memcpy(buf, c, n);
  buf[n] = '\0';
}

static int is_conv1d_module(const char *c) {
  return strcmp(c, "c_attn") == 0 || strcmp(c, "c_proj") == 0 ||
         strcmp(c, "c_fc") == 0 || strcmp(c, "q_attn") == 0;
}

int bico__family_transposed(int family, const char *tensor, size_t ndim) {
  if (family != BICO__FAMILY_GPT2 || ndim != 2 || tensor == NULL) return 0;
  size_t n = strlen(tensor);
  if (n < 7 || strcmp(tensor + n - 7, ".weight") != 0) return 0;
  char mod[64];
  module_tail(tensor, mod, sizeof mod);
  return is_conv1d_module(mod);
}

int bico__family_role(int family, const char *tensor, size_t ndim) {
  if (tensor == NULL) return 0;
  const char *last = last_component(tensor, strlen(tensor));
  char mod[64];
  module_tail(tensor, mod, sizeof mod);
  if (family == BICO__FAMILY_GPT2 && strcmp(mod, "attn") == 0 &&
      (strcmp(last, "bias") == 0 || strcmp(last, "masked_bias") == 0))
    return BICO_ROLE_OTHER; /* the causal mask buffers of old checkpoints */
  if (family == BICO__FAMILY_CLIP && strcmp(last, "class_embedding") == 0 &&
      ndim >= 1)
    return BICO_ROLE_TOKEN; /* [d]: added to the stream like a cls token */
  if (family == BICO__FAMILY_CLIP && strcmp(last, "position_ids") == 0)
    return BICO_ROLE_OTHER;
  return 0;
}

size_t bico__family_split(int family, const char *module) {
  if (family != BICO__FAMILY_GPT2 || module == NULL) return 1;
  const char *c = last_component(module, strlen(module));
  return strcmp(c, "c_attn") == 0 ? 3 : 1;
}

static const char *const CLIP_CONTAINERS[] = {
    "vision_model.encoder.layers", "text_model.encoder.layers", NULL};

const char *const *bico__family_containers(int family) {
  return family == BICO__FAMILY_CLIP ? CLIP_CONTAINERS : NULL;
}

size_t bico__family_tower(int family, const char *name) {
  if (family != BICO__FAMILY_CLIP || name == NULL) return 0;
  if (strncmp(name, "vision_model.", 13) == 0) return 13;
  if (strncmp(name, "text_model.", 11) == 0) return 11;
  return 0;
}

/* model_type of a folder's config.json, or 0. */
static int from_config(bico_ctx *ctx, const char *path, char *why,
                       size_t cap) {
  struct stat s;
  if (path == NULL || stat(path, &s) != 0 || !S_ISDIR(s.st_mode)) return 0;
  char cfg[4096];
  int w = snprintf(cfg, sizeof cfg, "%s/config.json", path);
  if (w <= 0 || (size_t)w >= sizeof cfg) return 0;
  if (stat(cfg, &s) != 0 || !S_ISREG(s.st_mode)) return 0;
  char *text = NULL;
  size_t len = 0;
  bico__json_doc *doc = NULL;
  int family = 0;
  char err[BICO_ERRMSG_CAP];
  snprintf(err, sizeof err, "%s", bico_ctx_errmsg(ctx));
  bico_status code = bico_ctx_errcode(ctx);
  if (bico__read_file(ctx, "config", "config.json", cfg, (size_t)16 << 20,
                      &text, &len) == BICO_OK &&
      bico__json_parse(ctx, cfg, text, len, &doc) == BICO_OK) {
    const bico__json *mt = bico__json_get(&doc->root, "model_type");
    if (mt != NULL && mt->type == BICO__JSON_STRING) {
      if (strcmp(mt->u.s, "gpt2") == 0)
        family = BICO__FAMILY_GPT2;
      else if (strncmp(mt->u.s, "clip", 4) == 0)
        family = BICO__FAMILY_CLIP;
      if (family)
        snprintf(why, cap, "config.json model_type \"%s\"", mt->u.s);
    }
  }
  bico__json_doc_free(doc);
  bico__free(ctx, text);
  /* A config.json that fails to read is not this function's failure. */
  if (code == BICO_OK) bico__clear(ctx);
  else bico__fail(ctx, code, "%s", err);
  return family;
}

int bico__family_detect(bico_ctx *ctx, const char *path, const bico_model *m,
                        char *why, size_t cap) {
  why[0] = '\0';
  int f = from_config(ctx, path, why, cap);
  if (f) return f;
  size_t n = bico_model_tensor_count(m);
  for (size_t i = 0; i < n; i++) {
    const char *name;
    if (bico_model_tensor(m, i, &name, NULL, NULL, NULL) != BICO_OK) continue;
    char mod[64];
    module_tail(name, mod, sizeof mod);
    const char *c;
    if (strcmp(mod, "c_attn") == 0 && (c = strstr(name, "attn.c_attn.")) &&
        (c == name || c[-1] == '.')) {
      snprintf(why, cap, "tensor names (%s)", name);
      return BICO__FAMILY_GPT2;
    }
    for (const char *const *p = CLIP_CONTAINERS; *p; p++) {
      size_t k = strlen(*p);
      if (strncmp(name, *p, k) == 0 && name[k] == '.' &&
          name[k + 1] >= '0' && name[k + 1] <= '9') {
        snprintf(why, cap, "tensor names (%s)", name);
        return BICO__FAMILY_CLIP;
      }
    }
  }
  return BICO__FAMILY_NONE;
}
