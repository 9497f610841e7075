/* `bico transfer --config F.yaml` and `bico merge --config F.yaml`: a YAML
 * file (parsed by libyaml) is translated into the command's own options,
 * placed where --config stood, so that every option keeps one meaning and
 * one check (the command's parser).  Options after --config on the command
 * line add to, or are refused as repeats of, those from the file.
 *
 * Generic rule, both commands: a top-level key `foo_bar` (or `foo-bar`)
 * with a scalar value becomes `--foo-bar VALUE`; `true` becomes the flag
 * `--foo-bar`, `false` leaves it out (`normalize: false` becomes
 * `--no-normalize`); a sequence repeats the option; a mapping becomes
 * `--foo-bar KEY=VALUE` per entry (`split: {attn.qkv: 3}`).
 *
 * mergekit's schema, for `bico merge`, where the concepts match:
 *   merge_method: linear | task_arithmetic | ties   -> --method
 *   base_model: B                                     -> --base
 *   models: [{model: M, parameters: {weight, density}}, ...]
 *       model -> --tuned (a model listed with the base's path is skipped,
 *       as mergekit lists the base among the models); bico's extensions
 *       `task_vector: T` -> --task-vector, `lora: DIR` -> --lora
 *   parameters: {normalize, lambda (= alpha), alpha}
 *   dtype, tokenizer_source, chat_template: not bico's concern; ignored
 *       with a note on stderr. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <yaml.h>

#include "cli.h"

typedef struct {
  char **v;
  size_t n, cap;
  const char *cmd, *file;
  int failed;
} argbuf;

static int cfg_error(argbuf *b, const yaml_node_t *at, const char *fmt,
                     const char *what) {
  char msg[512];
  snprintf(msg, sizeof msg, fmt, what);
  if (at != NULL)
    cli_error(b->cmd, CLI_USAGE, "--config %s, line %lu: %s", b->file,
              (unsigned long)at->start_mark.line + 1, msg);
  else
    cli_error(b->cmd, CLI_USAGE, "--config %s: %s", b->file, msg);
  b->failed = 1;
  return -1;
}

static int push(argbuf *b, const char *s) {
  if (b->n + 2 > b->cap) {
    size_t cap = b->cap ? 2 * b->cap : 32;
    char **v = realloc(b->v, cap * sizeof *v);
    if (v == NULL) return -1;
    b->v = v;
    b->cap = cap;
  }
  size_t len = strlen(s);
  char *c = malloc(len + 1);
  if (c == NULL) return -1;
  memcpy(c, s, len + 1);
  b->v[b->n++] = c;
  b->v[b->n] = NULL;
  return 0;
}

static int push_opt(argbuf *b, const char *key) {
  char opt[256];
  size_t n = strlen(key);
  if (n == 0 || n + 3 > sizeof opt) return -1;
  opt[0] = opt[1] = '-';
  for (size_t i = 0; i <= n; i++) opt[i + 2] = key[i] == '_' ? '-' : key[i];
  return push(b, opt);
}

static const char *scalar(const yaml_node_t *n) {
  return n != NULL && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value
                                                  : NULL;
}

/* YAML's null: a plain ~, null, Null or NULL (an empty value is refused
 * on its own). */
static int is_null(const yaml_node_t *n) {
  const char *s = scalar(n);
  return s != NULL && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
         (strcmp(s, "~") == 0 || strcmp(s, "null") == 0 ||
          strcmp(s, "Null") == 0 || strcmp(s, "NULL") == 0);
}

static int is_true(const char *s) {
  return strcmp(s, "true") == 0 || strcmp(s, "True") == 0 ||
         strcmp(s, "yes") == 0 || strcmp(s, "on") == 0;
}
static int is_false(const char *s) {
  return strcmp(s, "false") == 0 || strcmp(s, "False") == 0 ||
         strcmp(s, "no") == 0 || strcmp(s, "off") == 0;
}

/* key: scalar | sequence of scalars | mapping of scalars, as options. */
static int generic(argbuf *b, yaml_document_t *d, const char *key,
                   yaml_node_t *val) {
  const char *s = scalar(val);
  if (s != NULL) {
    if (is_null(val))
      return cfg_error(b, val, "key '%s' is null (give it a value, or leave "
                               "the key out)", key);
    if (is_true(s)) return push_opt(b, key);
    if (is_false(s)) {
      if (strcmp(key, "normalize") == 0) return push(b, "--no-normalize");
      return 0;
    }
    if (s[0] == '\0') return cfg_error(b, val, "key '%s' has an empty value", key);
    return push_opt(b, key) || push(b, s) ? -1 : 0;
  }
  if (val->type == YAML_SEQUENCE_NODE) {
    for (yaml_node_item_t *it = val->data.sequence.items.start;
         it < val->data.sequence.items.top; it++) {
      yaml_node_t *en = yaml_document_get_node(d, *it);
      const char *e = scalar(en);
      if (e != NULL && (is_null(en) || e[0] == '\0'))
        return cfg_error(b, en, "the list under '%s' holds a null or empty "
                                "value", key);
      if (e == NULL)
        return cfg_error(b, val, "the list under '%s' must hold plain values", key);
      if (push_opt(b, key) || push(b, e)) return -1;
    }
    return 0;
  }
  for (yaml_node_pair_t *p = val->data.mapping.pairs.start;
       p < val->data.mapping.pairs.top; p++) {
    const char *k = scalar(yaml_document_get_node(d, p->key));
    yaml_node_t *vn = yaml_document_get_node(d, p->value);
    const char *v = scalar(vn);
    if (k == NULL || v == NULL || is_null(vn) || v[0] == '\0')
      return cfg_error(b, val, "the mapping under '%s' must map names to values", key);
    size_t len = strlen(k) + strlen(v) + 2;
    char *kv = malloc(len);
    if (kv == NULL) return -1;
    snprintf(kv, len, "%s=%s", k, v);
    int r = push_opt(b, key) || push(b, kv) ? -1 : 0;
    free(kv);
    if (r) return r;
  }
  return 0;
}

static yaml_node_t *get(yaml_document_t *d, yaml_node_t *map, const char *key) {
  if (map == NULL || map->type != YAML_MAPPING_NODE) return NULL;
  for (yaml_node_pair_t *p = map->data.mapping.pairs.start;
       p < map->data.mapping.pairs.top; p++) {
    const char *k = scalar(yaml_document_get_node(d, p->key));
    if (k != NULL && strcmp(k, key) == 0)
      return yaml_document_get_node(d, p->value);
  }
  return NULL;
}

/* One entry of mergekit's `models:` list. */
static int merge_model(argbuf *b, yaml_document_t *d, yaml_node_t *m,
                       const char *base) {
  static const char *const KINDS[][2] = {
      {"model", "--tuned"}, {"task_vector", "--task-vector"}, {"lora", "--lora"}};
  if (m->type != YAML_MAPPING_NODE)
    return cfg_error(b, m, "%s", "each entry of 'models' is a mapping (model: PATH)");
  const char *path = NULL, *opt = NULL;
  for (size_t k = 0; k < 3; k++) {
    yaml_node_t *n = get(d, m, KINDS[k][0]);
    if (n == NULL) continue;
    if (path != NULL || scalar(n) == NULL || scalar(n)[0] == '\0' || is_null(n))
      return cfg_error(b, m, "%s", "an entry of 'models' names one path, under "
                                   "one of model, task_vector or lora");
    path = scalar(n);
    opt = KINDS[k][1];
  }
  if (path == NULL)
    return cfg_error(b, m, "%s", "an entry of 'models' lacks model, task_vector or lora");
  for (yaml_node_pair_t *p = m->data.mapping.pairs.start;
       p < m->data.mapping.pairs.top; p++) {
    const char *k = scalar(yaml_document_get_node(d, p->key));
    if (k == NULL || (strcmp(k, "model") && strcmp(k, "task_vector") &&
                      strcmp(k, "lora") && strcmp(k, "parameters")))
      return cfg_error(b, m, "unknown key '%s' in an entry of 'models'", k ? k : "?");
  }
  yaml_node_t *params = get(d, m, "parameters");
  /* the base by identity: "./B", "B/", a link to B are the base too */
  if (base != NULL && strcmp(opt, "--tuned") == 0 && cli_same_model(path, base)) {
    if (params != NULL)
      return cfg_error(b, m, "%s", "the base model is listed among 'models' with "
                                   "parameters; the base takes none");
    return 0; /* mergekit lists the base among the models */
  }
  if (push(b, opt) || push(b, path)) return -1;
  if (params == NULL) return 0;
  if (params->type != YAML_MAPPING_NODE)
    return cfg_error(b, params, "%s", "'parameters' of a model is a mapping");
  for (yaml_node_pair_t *p = params->data.mapping.pairs.start;
       p < params->data.mapping.pairs.top; p++) {
    const char *k = scalar(yaml_document_get_node(d, p->key));
    const char *v = scalar(yaml_document_get_node(d, p->value));
    if (k == NULL || v == NULL || (strcmp(k, "weight") && strcmp(k, "density")))
      return cfg_error(b, params, "model parameter '%s' (bico knows weight and density)",
                       k ? k : "?");
    if (push_opt(b, k) || push(b, v)) return -1;
  }
  return 0;
}

static int merge_key(argbuf *b, yaml_document_t *d, yaml_node_t *root,
                     const char *key, yaml_node_t *val) {
  if (strcmp(key, "merge_method") == 0) {
    if (scalar(val) == NULL || is_null(val) || scalar(val)[0] == '\0')
      return cfg_error(b, val, "%s", "merge_method is a name");
    return push(b, "--method") || push(b, scalar(val)) ? -1 : 0;
  }
  if (strcmp(key, "base_model") == 0) {
    if (scalar(val) == NULL || is_null(val) || scalar(val)[0] == '\0')
      return cfg_error(b, val, "%s", "base_model is a path");
    return push(b, "--base") || push(b, scalar(val)) ? -1 : 0;
  }
  if (strcmp(key, "models") == 0) {
    if (val->type != YAML_SEQUENCE_NODE)
      return cfg_error(b, val, "%s", "'models' is a list");
    const char *base = scalar(get(d, root, "base_model"));
    for (yaml_node_item_t *it = val->data.sequence.items.start;
         it < val->data.sequence.items.top; it++)
      if (merge_model(b, d, yaml_document_get_node(d, *it), base)) return -1;
    return 0;
  }
  if (strcmp(key, "parameters") == 0) {
    if (val->type != YAML_MAPPING_NODE)
      return cfg_error(b, val, "%s", "'parameters' is a mapping");
    for (yaml_node_pair_t *p = val->data.mapping.pairs.start;
         p < val->data.mapping.pairs.top; p++) {
      const char *k = scalar(yaml_document_get_node(d, p->key));
      yaml_node_t *v = yaml_document_get_node(d, p->value);
      if (k == NULL || (strcmp(k, "normalize") && strcmp(k, "lambda") &&
                        strcmp(k, "alpha")))
        return cfg_error(b, val, "parameter '%s' (bico knows normalize, lambda, alpha)",
                         k ? k : "?");
      if (generic(b, d, strcmp(k, "lambda") == 0 ? "alpha" : k, v)) return -1;
    }
    return 0;
  }
  if (!strcmp(key, "dtype") || !strcmp(key, "tokenizer_source") ||
      !strcmp(key, "chat_template")) {
    fprintf(stderr, "bico %s: --config %s: '%s' ignored (outputs keep the base's "
            "dtypes; tokenizers are not bico's concern)\n", b->cmd, b->file, key);
    return 0;
  }
  return generic(b, d, key, val);
}

static int translate(argbuf *b, yaml_document_t *d) {
  yaml_node_t *root = yaml_document_get_root_node(d);
  if (root == NULL) return cfg_error(b, NULL, "%s", "the file is empty");
  if (root->type != YAML_MAPPING_NODE)
    return cfg_error(b, root, "%s", "the top level must be a mapping (key: value)");
  int merge = strcmp(b->cmd, "merge") == 0;
  for (yaml_node_pair_t *p = root->data.mapping.pairs.start;
       p < root->data.mapping.pairs.top; p++) {
    yaml_node_t *kn = yaml_document_get_node(d, p->key);
    const char *key = scalar(kn);
    if (key == NULL || key[0] == '\0' || key[0] == '-')
      return cfg_error(b, kn, "%s", "keys are plain option names");
    for (const char *c = key; *c; c++)
      if (!(isalnum((unsigned char)*c) || *c == '_' || *c == '-'))
        return cfg_error(b, kn, "'%s' is not an option name", key);
    if (!strcmp(key, "config"))
      return cfg_error(b, kn, "%s", "a config file cannot name another one");
    yaml_node_t *val = yaml_document_get_node(d, p->value);
    int r = merge ? merge_key(b, d, root, key, val) : generic(b, d, key, val);
    if (r) return r;
  }
  return 0;
}

/* Bounds checked before libyaml builds a document (its loader is
 * quadratic in the nesting depth: 200 KB of '[' never finishes). */
#define MAX_CONFIG_BYTES ((size_t)1 << 20)
#define MAX_CONFIG_DEPTH 64

/* The file into memory: a regular file of at most MAX_CONFIG_BYTES. */
static int read_config(argbuf *b, const char *path, unsigned char **text,
                       size_t *len) {
  FILE *f = fopen(path, "rb");
  struct stat s;
  if (f == NULL) {
    cli_error(b->cmd, CLI_USAGE, "--config %s: cannot open it", path);
    b->failed = 1;
    return -1;
  }
  if (fstat(fileno(f), &s) != 0 || !S_ISREG(s.st_mode)) {
    fclose(f);
    return cfg_error(b, NULL, "%s", "not a regular file");
  }
  unsigned char *buf = malloc(MAX_CONFIG_BYTES + 1);
  if (buf == NULL) {
    fclose(f);
    return -1;
  }
  size_t n = fread(buf, 1, MAX_CONFIG_BYTES + 1, f);
  int err = ferror(f);
  fclose(f);
  if (err || n > MAX_CONFIG_BYTES) {
    free(buf);
    if (err) return cfg_error(b, NULL, "%s", "cannot read it");
    return cfg_error(b, NULL, "%s", "larger than 1 MiB (a configuration file "
                                    "is a few lines of options)");
  }
  *text = buf;
  *len = n;
  return 0;
}

/* One pass of libyaml's event parser, linear in the file as long as the
 * nesting stays shallow: refuses nesting deeper than MAX_CONFIG_DEPTH and
 * a second document, before the loader runs. */
static int prescan(argbuf *b, const unsigned char *text, size_t len) {
  yaml_parser_t p;
  yaml_event_t e;
  if (!yaml_parser_initialize(&p)) return -1;
  yaml_parser_set_input_string(&p, text, len);
  int depth = 0, docs = 0, r = 0;
  for (;;) {
    if (!yaml_parser_parse(&p, &e)) {
      cli_error(b->cmd, CLI_USAGE, "--config %s, line %lu: %s", b->file,
                (unsigned long)p.problem_mark.line + 1,
                p.problem ? p.problem : "not valid YAML");
      b->failed = 1;
      r = -1;
      break;
    }
    yaml_event_type_t t = e.type;
    unsigned long line = (unsigned long)e.start_mark.line + 1;
    yaml_event_delete(&e);
    if (t == YAML_STREAM_END_EVENT) break;
    if (t == YAML_DOCUMENT_START_EVENT && ++docs > 1) {
      cli_error(b->cmd, CLI_USAGE, "--config %s, line %lu: a second YAML "
                "document (a configuration file holds one)", b->file, line);
      b->failed = 1;
      r = -1;
      break;
    }
    if (t == YAML_SEQUENCE_START_EVENT || t == YAML_MAPPING_START_EVENT) {
      if (++depth > MAX_CONFIG_DEPTH) {
        cli_error(b->cmd, CLI_USAGE, "--config %s, line %lu: nested deeper "
                  "than %d levels", b->file, line, MAX_CONFIG_DEPTH);
        b->failed = 1;
        r = -1;
        break;
      }
    } else if (t == YAML_SEQUENCE_END_EVENT || t == YAML_MAPPING_END_EVENT) {
      depth--;
    }
  }
  yaml_parser_delete(&p);
  return r;
}

typedef struct {
  const char *key;
  unsigned long line;
} keyline;

static int keyline_cmp(const void *x, const void *y) {
  const keyline *a = x, *c = y;
  int r = strcmp(a->key, c->key);
  return r ? r : (a->line > c->line) - (a->line < c->line);
}

/* A key given twice in one mapping, anywhere in the document, is an error
 * (libyaml keeps both; options would be last-wins). */
static int duplicate_keys(argbuf *b, yaml_document_t *d) {
  for (yaml_node_t *n = d->nodes.start; n < d->nodes.top; n++) {
    if (n->type != YAML_MAPPING_NODE) continue;
    size_t m = (size_t)(n->data.mapping.pairs.top - n->data.mapping.pairs.start);
    if (m < 2) continue;
    keyline *k = malloc(m * sizeof *k);
    if (k == NULL) return -1;
    size_t c = 0;
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start;
         p < n->data.mapping.pairs.top; p++) {
      yaml_node_t *kn = yaml_document_get_node(d, p->key);
      if (scalar(kn) == NULL) continue;
      k[c].key = scalar(kn);
      k[c++].line = (unsigned long)kn->start_mark.line + 1;
    }
    qsort(k, c, sizeof *k, keyline_cmp);
    for (size_t i = 1; i < c; i++)
      if (strcmp(k[i - 1].key, k[i].key) == 0) {
        cli_error(b->cmd, CLI_USAGE, "--config %s, line %lu: key '%.200s' "
                  "given twice (also on line %lu)", b->file, k[i].line,
                  k[i].key, k[i - 1].line);
        b->failed = 1;
        free(k);
        return -1;
      }
    free(k);
  }
  return 0;
}

static int load(argbuf *b, const char *path) {
  unsigned char *text = NULL;
  size_t len = 0;
  if (read_config(b, path, &text, &len)) return -1;
  if (prescan(b, text, len)) {
    free(text);
    return -1;
  }
  yaml_parser_t parser;
  yaml_document_t doc;
  int r = -1;
  if (!yaml_parser_initialize(&parser)) {
    free(text);
    return -1;
  }
  yaml_parser_set_input_string(&parser, text, len);
  if (!yaml_parser_load(&parser, &doc)) {
    cli_error(b->cmd, CLI_USAGE, "--config %s, line %lu: %s", path,
              (unsigned long)parser.problem_mark.line + 1,
              parser.problem ? parser.problem : "not valid YAML");
    b->failed = 1;
  } else {
    r = duplicate_keys(b, &doc);
    if (r == 0) r = translate(b, &doc);
    yaml_document_delete(&doc);
  }
  yaml_parser_delete(&parser);
  free(text);
  return r;
}

static argbuf expanded;

static void release(void) {
  cli_args_from_config(NULL, -1, -1);
  for (size_t i = 0; i < expanded.n; i++) free(expanded.v[i]);
  free(expanded.v);
  expanded.v = NULL;
  expanded.n = expanded.cap = 0;
}

int cli_config_expand(const char *cmd, int *argc, char ***argv) {
  int at = -1;
  const char *path = NULL;
  int first = -1; /* where --config starts; `at` is where it ends */
  for (int i = 1; i < *argc; i++) {
    const char *v = NULL;
    int start = i;
    int r = cli_opt(*argc, *argv, &i, "--config", &v);
    if (r < 0) return cli_error(cmd, CLI_USAGE, "option --config needs a value");
    if (r == 0) continue;
    if (path != NULL) return cli_error(cmd, CLI_USAGE, "option --config given twice");
    if (v[0] == '\0') return cli_error(cmd, CLI_USAGE, "option --config has an empty path");
    path = v;
    first = start;
    at = i;
  }
  if (path == NULL) return 0;
  argbuf *b = &expanded;
  b->cmd = cmd;
  b->file = path;
  atexit(release);
  /* argv[0], the options before --config, the file's, then the rest. */
  int ok = 1;
  for (int i = 0; i < first && ok; i++) ok = push(b, (*argv)[i]) == 0;
  int from_lo = (int)b->n;
  cli_args_from_config(path, from_lo, -1); /* the file named, no range */
  if (ok && load(b, path) != 0) {
    if (!b->failed) cli_error(cmd, CLI_FAIL, "--config %s: out of memory", path);
    return b->failed ? CLI_USAGE : CLI_FAIL;
  }
  cli_args_from_config(path, from_lo, (int)b->n);
  for (int i = at + 1; i < *argc && ok; i++) ok = push(b, (*argv)[i]) == 0;
  if (!ok) return cli_error(cmd, CLI_FAIL, "--config %s: out of memory", path);
  *argc = (int)b->n;
  *argv = b->v;
  return 0;
}
