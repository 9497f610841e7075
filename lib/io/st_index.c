/* safetensors: sharded checkpoints (model.safetensors.index.json). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"
#include "st_internal.h"
#include "strindex.h"

#define HEADER_LIMIT BICO__ST_HEADER_LIMIT

typedef bico__st_tensor st_tensor;
#define shortname bico__st_shortname

static int cmp_name(const void *a, const void *b) {
  const st_tensor *x = *(st_tensor *const *)a, *y = *(st_tensor *const *)b;
  return strcmp(x->name, y->name);
}

static const char *shard_key(const void *owner, size_t i) {
  return ((const char *const *)owner)[i];
}

typedef struct wm_entry {
  const char *tensor;
  size_t shard;
} wm_entry;

static int cmp_wm(const void *a, const void *b) {
  return strcmp(((const wm_entry *)a)->tensor, ((const wm_entry *)b)->tensor);
}

/* Index metadata: strings as they are, numbers as their JSON text. */
static bico_status index_meta(bico_stfile *f, const bico__json *md) {
  bico_ctx *ctx = f->ctx;
  if (md == NULL || md->n == 0) return BICO_OK;
  f->meta = bico__arena_alloc(&f->arena, md->n * sizeof *f->meta);
  if (f->meta == NULL) return BICO_E_NOMEM;
  for (size_t k = 0; k < md->n; k++) {
    const bico__json_member *e = &md->u.members[k];
    char num[64];
    const char *val = NULL;
    if (e->value.type == BICO__JSON_STRING)
      val = e->value.u.s;
    else if (e->value.type == BICO__JSON_INT) {
      snprintf(num, sizeof num, "%lld", (long long)e->value.u.i);
      val = num;
    } else if (e->value.type == BICO__JSON_REAL) {
      /* render through the JSON writer: locale-independent */
      bico__jw jw;
      bico__jw_init(&jw, ctx, 0);
      bico__jw_double(&jw, e->value.u.d);
      if (jw.err == BICO_OK && jw.len < sizeof num) {
        memcpy(num, jw.buf, jw.len + 1);
        val = num;
      }
      bico__jw_free(&jw);
    }
    if (val == NULL) continue;
    bico__st_meta *mm = &f->meta[f->nmeta];
    mm->key = bico__arena_strndup(&f->arena, e->key, strlen(e->key));
    mm->value = bico__arena_strndup(&f->arena, val, strlen(val));
    if (!mm->key || !mm->value) {
      return BICO_E_NOMEM;
    }
    f->nmeta++;
  }
  return BICO_OK;
}

/* Every weight_map entry must be in its shard and every shard tensor in
 * the weight_map under that shard. */
static bico_status check_assignment(bico_stfile *f, const char *path,
                                    wm_entry *ents, size_t nw,
                                    const char **shards) {
  bico_ctx *ctx = f->ctx;
  bico_status st = BICO_OK;
  qsort(ents, nw, sizeof *ents, cmp_wm);
  for (size_t k = 0; k < f->count; k++) {
    const st_tensor *t = &f->tensors[k];
    wm_entry key = {t->name, 0};
    const wm_entry *hit = bsearch(&key, ents, nw, sizeof *ents, cmp_wm);
    char nb[160];
    if (hit == NULL) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: shard '%s' holds tensor '%s' that the "
                      "weight_map does not list",
                      path, shards[t->file], shortname(t->name, nb, sizeof nb));
      return st;
    }
    if (hit->shard != t->file) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: tensor '%s' is in shard '%s' but the "
                      "weight_map assigns it to '%s'",
                      path, shortname(t->name, nb, sizeof nb),
                      shards[t->file], shards[hit->shard]);
      return st;
    }
  }
  if (f->count != nw) {
    /* Some listed tensor is missing: find it for the message. */
    st_tensor **byname = bico__alloc(ctx, (f->count ? f->count : 1) * sizeof *byname);
    if (byname == NULL) {
      st = BICO_E_NOMEM;
      return st;
    }
    for (size_t k = 0; k < f->count; k++) byname[k] = &f->tensors[k];
    qsort(byname, f->count, sizeof *byname, cmp_name);
    for (size_t k = 0; k < nw; k++) {
      st_tensor probe;
      probe.name = ents[k].tensor;
      st_tensor *pp = &probe;
      if (bsearch(&pp, byname, f->count, sizeof *byname, cmp_name) == NULL) {
        char nb[160];
        st = bico__fail(ctx, BICO_E_FORMAT,
                        "stfile_open: %s: weight_map lists tensor '%s' in "
                        "shard '%s', which does not hold it",
                        path, shortname(ents[k].tensor, nb, sizeof nb),
                        shards[ents[k].shard]);
        break;
      }
    }
    bico__free(ctx, byname);
    if (st == BICO_OK)
      st = bico__fail(ctx, BICO_E_INTERNAL,
                      "stfile_open: %s: tensor count mismatch", path);
  }
  return st;
}

bico_status bico__st_load_index(bico_stfile *f, const char *path) {
  bico_ctx *ctx = f->ctx;
  char *text = NULL;
  size_t len = 0;
  bico_status st = bico__read_file(ctx, "stfile_open", "index", path,
                                   HEADER_LIMIT, &text, &len);
  if (st != BICO_OK) return st;
  char what[512];
  snprintf(what, sizeof what, "stfile_open: %s", path);
  bico__json_doc *doc = NULL;
  st = bico__json_parse(ctx, what, text, len, &doc);
  bico__free(ctx, text);
  if (st != BICO_OK) return st;
  const bico__json *root = &doc->root, *wm = bico__json_get(root, "weight_map");
  const bico__json *md = bico__json_get(root, "metadata");
  wm_entry *ents = NULL;
  const char **shards = NULL;
  bico__strindex ix = {NULL, 0};
  size_t nshards = 0;
  if (root->type != BICO__JSON_OBJECT || wm == NULL ||
      wm->type != BICO__JSON_OBJECT) {
    st = bico__fail(ctx, BICO_E_FORMAT,
                    "stfile_open: %s: index lacks a \"weight_map\" object",
                    path);
    goto done;
  }
  if (md != NULL && md->type != BICO__JSON_OBJECT) {
    st = bico__fail(ctx, BICO_E_FORMAT,
                    "stfile_open: %s: index \"metadata\" is not an object "
                    "(%s)",
                    path, bico__json_type_name(md->type));
    goto done;
  }
  st = index_meta(f, md);
  if (st != BICO_OK) goto done;
  /* The folder of the index holds the shards. */
  const char *slash = strrchr(path, '/');
  size_t dirlen = slash ? (size_t)(slash - path) + 1 : 0;
  size_t nw = wm->n;
  ents = bico__alloc(ctx, (nw ? nw : 1) * sizeof *ents);
  shards = bico__alloc(ctx, (nw ? nw : 1) * sizeof *shards);
  if (ents == NULL || shards == NULL) {
    st = BICO_E_NOMEM;
    goto done;
  }
  for (size_t k = 0; k < nw; k++) {
    const bico__json_member *e = &wm->u.members[k];
    char nb[160];
    const char *sh = e->value.u.s;
    if (e->value.type != BICO__JSON_STRING) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: weight_map entry for tensor '%s' is "
                      "not a file name (%s)",
                      path, shortname(e->key, nb, sizeof nb),
                      bico__json_type_name(e->value.type));
      goto done;
    }
    if (e->value.n == 0 || strlen(sh) != e->value.n || strchr(sh, '/') ||
        strcmp(sh, ".") == 0 || strcmp(sh, "..") == 0 ||
        strlen(e->key) != e->key_len) {
      st = bico__fail(ctx, BICO_E_FORMAT,
                      "stfile_open: %s: weight_map entry for tensor '%s' names "
                      "shard '%s', not a file in the index's folder",
                      path, shortname(e->key, nb, sizeof nb), sh);
      goto done;
    }
    /* A hash of the shard names: a linear search per entry made an index
     * with 100k distinct shards take half a minute. */
    size_t s = bico__strindex_find(&ix, sh, strlen(sh), shard_key, shards);
    if (s == SIZE_MAX) {
      s = nshards;
      shards[nshards++] = sh;
      st = bico__strindex_reserve(ctx, &ix, nshards, shard_key, shards);
      if (st != BICO_OK) goto done;
      bico__strindex_insert(&ix, s, shard_key, shards);
    }
    ents[k].tensor = e->key;
    ents[k].shard = s;
  }
  f->files = bico__calloc(ctx, nshards ? nshards : 1, sizeof *f->files);
  if (f->files == NULL) {
    st = BICO_E_NOMEM;
    goto done;
  }
  for (size_t s = 0; s < nshards; s++) {
    size_t sl = strlen(shards[s]);
    char *sp = bico__arena_alloc(&f->arena, dirlen + sl + 1);
    if (sp == NULL) {
      st = BICO_E_NOMEM;
      goto done;
    }
    memcpy(sp, path, dirlen);
    memcpy(sp + dirlen, shards[s], sl + 1);
    f->files[s].path = sp;
    f->files[s].fd = -1;
    f->nfiles = s + 1;
    st = bico__st_load_one(f, s, 0);
    if (st != BICO_OK) {
      /* say which index referred to the shard */
      char msg[BICO_ERRMSG_CAP];
      snprintf(msg, sizeof msg, "%s", bico_ctx_errmsg(ctx));
      bico__fail(ctx, st, "%s (shard '%s' of index %s)", msg, shards[s], path);
      goto done;
    }
  }
  st = check_assignment(f, path, ents, nw, shards);
done:
  bico__strindex_free(ctx, &ix);
  bico__free(ctx, ents);
  bico__free(ctx, shards);
  bico__json_doc_free(doc);
  return st;
}
/* ---- renaming (a transfer's --source-rename) ---- */

bico_status bico__stfile_rename_prefix(bico_stfile *f, const char *rule) {
  bico_ctx *ctx = f->ctx;
  const char *eq = strchr(rule, '=');
  if (eq == NULL)
    return bico__fail(ctx, BICO_E_ARG, "rename '%s': expected OLD=NEW", rule);
  size_t ol = (size_t)(eq - rule), nl = strlen(eq + 1);
  for (size_t k = 0; k < f->count; k++) {
    st_tensor *t = &f->tensors[k];
    size_t len = strlen(t->name);
    if (len < ol || strncmp(t->name, rule, ol) != 0) continue;
    char *n = bico__arena_alloc(&f->arena, nl + len - ol + 1);
    if (n == NULL) return BICO_E_NOMEM;
    memcpy(n, eq + 1, nl);
    memcpy(n + nl, t->name + ol, len - ol + 1);
    t->name = n;
  }
  /* re-sort, as bico_stfile_open sorts */
  st_tensor **tmp = bico__alloc(ctx, (f->count ? f->count : 1) * sizeof *tmp);
  if (tmp == NULL) return BICO_E_NOMEM;
  for (size_t k = 0; k < f->count; k++) tmp[k] = &f->tensors[k];
  qsort(tmp, f->count, sizeof *tmp, cmp_name);
  for (size_t k = 0; k < f->count; k++)
    f->by_name[k] = (size_t)(tmp[k] - f->tensors);
  bico__free(ctx, tmp);
  for (size_t k = 1; k < f->count; k++)
    if (strcmp(f->tensors[f->by_name[k]].name,
               f->tensors[f->by_name[k - 1]].name) == 0) {
      char nb[160];
      return bico__fail(ctx, BICO_E_ARG,
                        "rename '%s' of %s: two tensors become '%s'", rule,
                        f->path, shortname(f->tensors[f->by_name[k]].name, nb,
                                           sizeof nb));
    }
  return BICO_OK;
}
