/* What a user names as a model, resolved to the file libbico reads.
 *
 * Users hold Hugging Face model folders: config.json beside
 * model.safetensors, or model.safetensors.index.json and its shards, plus
 * tokenizer files.  Every function that opens a checkpoint by path accepts
 * such a folder; a file is taken as it is.  A folder that holds a PEFT
 * adapter or PyTorch pickles instead is named for what it is, with what to
 * do about it. */
#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "modelpath.h"

static int exists_regular(const char *path) {
  struct stat s;
  return stat(path, &s) == 0 && S_ISREG(s.st_mode);
}

static int join(char *buf, size_t cap, const char *dir, const char *name) {
  size_t n = strlen(dir);
  while (n > 1 && dir[n - 1] == '/') n--;
  int w = snprintf(buf, cap, "%.*s/%s", (int)n, dir, name);
  return w > 0 && (size_t)w < cap;
}

static int ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* The one *.safetensors file of a folder that is not an adapter (a
 * single-file checkpoint under another name), or none. */
static int single_safetensors(const char *dir, char *buf, size_t cap) {
  DIR *d = opendir(dir);
  if (d == NULL) return 0;
  int found = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (!ends_with(e->d_name, ".safetensors") || e->d_name[0] == '.' ||
        strcmp(e->d_name, "adapter_model.safetensors") == 0)
      continue;
    if (++found > 1) break;
    if (!join(buf, cap, dir, e->d_name)) found = 2;
  }
  closedir(d);
  return found == 1;
}

bico_status bico__model_file(bico_ctx *ctx, const char *path, char *buf,
                             size_t cap, const char **file) {
  struct stat s;
  *file = path;
  if (stat(path, &s) != 0 || !S_ISDIR(s.st_mode)) return BICO_OK;
  static const char *const WEIGHTS[] = {"model.safetensors.index.json",
                                        "model.safetensors"};
  for (size_t k = 0; k < sizeof WEIGHTS / sizeof *WEIGHTS; k++) {
    if (!join(buf, cap, path, WEIGHTS[k]))
      return bico__fail(ctx, BICO_E_ARG, "%s: path too long", path);
    if (exists_regular(buf)) {
      *file = buf;
      return BICO_OK;
    }
  }
  if (join(buf, cap, path, "adapter_config.json") && exists_regular(buf))
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: a PEFT adapter folder (adapter_config.json), not a "
                      "model: pass it as the LoRA adapter (--lora)", path);
  static const char *const PICKLES[] = {"pytorch_model.bin.index.json",
                                        "pytorch_model.bin"};
  for (size_t k = 0; k < sizeof PICKLES / sizeof *PICKLES; k++)
    if (join(buf, cap, path, PICKLES[k]) && exists_regular(buf))
      return bico__fail(ctx, BICO_E_FORMAT,
                        "%s: holds %s, PyTorch pickles, not safetensors: "
                        "convert with `python3 -m bico.convert %s %s`",
                        path, PICKLES[k], buf,
                        k == 0 ? "OUT_FOLDER/" : "OUT_FOLDER/model.safetensors");
  if (single_safetensors(path, buf, cap)) {
    *file = buf;
    return BICO_OK;
  }
  return bico__fail(ctx, BICO_E_NOTFOUND,
                    "%s: a folder without model.safetensors or "
                    "model.safetensors.index.json (nor a single *.safetensors "
                    "file)", path);
}

int bico__looks_like_pickle(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return 0;
  unsigned char h[4] = {0};
  size_t n = fread(h, 1, sizeof h, f);
  fclose(f);
  /* torch.save's zip archive, or a bare pickle (protocol 2 to 5). */
  if (n == 4 && h[0] == 'P' && h[1] == 'K' && h[2] == 3 && h[3] == 4) return 1;
  return n >= 2 && h[0] == 0x80 && h[1] >= 2 && h[1] <= 5 &&
         (ends_with(path, ".bin") || ends_with(path, ".pt") ||
          ends_with(path, ".pth") || ends_with(path, ".ckpt"));
}
