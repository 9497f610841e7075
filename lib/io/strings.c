/* Strings of the file plumbing: copies, paths and their parts, a file's
 * kind and a shape, for the messages that name them (lib/io/fileio.h). */
#define _DEFAULT_SOURCE 1 /* DT_* names, O_DIRECTORY */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "fileio.h"

char *bico__strndup(bico_ctx *ctx, const char *s, size_t n) {
  char *p = bico__alloc(ctx, n + 1);
  if (p == NULL) return NULL;
  memcpy(p, s, n);
  p[n] = '\0';
  return p;
}

char *bico__strdup(bico_ctx *ctx, const char *s) {
  return bico__strndup(ctx, s, strlen(s));
}

char *bico__path_join(bico_ctx *ctx, const char *dir, const char *file) {
  size_t a = strlen(dir), b = strlen(file);
  char *p = bico__alloc(ctx, a + b + 2);
  if (p == NULL) return NULL;
  memcpy(p, dir, a);
  size_t o = a;
  if (a == 0 || dir[a - 1] != '/') p[o++] = '/';
  memcpy(p + o, file, b + 1);
  return p;
}

char *bico__trim_slashes(const char *path) {
  size_t n = strlen(path);
  while (n > 1 && path[n - 1] == '/') n--;
  char *p = malloc(n + 1);
  if (p != NULL) {
    memcpy(p, path, n);
    p[n] = '\0';
  }
  return p;
}

const char *bico__kind_of(mode_t m) {
  if (S_ISREG(m)) return "a file";
  if (S_ISDIR(m)) return "a folder";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISLNK(m)) return "a symbolic link";
  return "of another type";
}

/* The folder part of path ("." when none; "/" for "/x") into buf. */
void bico__dir_of(const char *path, char *buf, size_t cap) {
  const char *slash = strrchr(path, '/');
  if (slash == NULL)
    snprintf(buf, cap, ".");
  else if (slash == path)
    snprintf(buf, cap, "/");
  else
    snprintf(buf, cap, "%.*s", (int)(slash - path), path);
}

const char *bico__base_of(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

const char *bico__shape_text(char *buf, size_t cap, size_t ndim,
                             const size_t *shape) {
  size_t n = 0;
  if (cap == 0) return buf;
  buf[0] = '\0';
  n += (size_t)snprintf(buf, cap, "[");
  for (size_t d = 0; d < ndim && n < cap; d++)
    n += (size_t)snprintf(buf + n, cap - n, "%s%zu", d ? ", " : "", shape[d]);
  if (n < cap) n += (size_t)snprintf(buf + n, cap - n, "]");
  if (n >= cap && cap > 4) memcpy(buf + cap - 4, "...", 4);
  return buf;
}
