/* Inputs read without blocking: only regular files, opened with O_NONBLOCK
 * so that a FIFO without a writer is refused, never waited on (lib/io/fileio.h). */
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

bico_status bico__open_input(bico_ctx *ctx, const char *fn, const char *path,
                             int *fd, uint64_t *size) {
  *fd = -1;
  /* O_NONBLOCK: opening a FIFO without a writer would wait forever. */
  int d = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (d < 0)
    return bico__fail(ctx, BICO_E_IO, "%s: %s: cannot open: %s", fn, path,
                      strerror(errno));
  struct stat st;
  if (fstat(d, &st) != 0) {
    int e = errno;
    close(d);
    return bico__fail(ctx, BICO_E_IO, "%s: %s: cannot stat: %s", fn, path,
                      strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(d);
    return bico__fail(ctx, BICO_E_IO, "%s: %s is %s, not a regular file", fn,
                      path, bico__kind_of(st.st_mode));
  }
  int fl = fcntl(d, F_GETFL);
  if (fl >= 0) (void)fcntl(d, F_SETFL, fl & ~O_NONBLOCK);
  *fd = d;
  if (size) *size = (uint64_t)st.st_size;
  return BICO_OK;
}

int bico__pread_all(int fd, void *buf, size_t n, uint64_t off) {
  unsigned char *p = buf;
  while (n > 0) {
    ssize_t r = pread(fd, p, n, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) return EIO;
    p += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return 0;
}

bico_status bico__read_file(bico_ctx *ctx, const char *fn, const char *what,
                            const char *path, size_t limit, char **out,
                            size_t *len) {
  *out = NULL;
  *len = 0;
  int fd;
  uint64_t size;
  bico_status st = bico__open_input(ctx, fn, path, &fd, &size);
  if (st != BICO_OK) return st;
  if (size > (uint64_t)limit) {
    close(fd);
    return bico__fail(ctx, BICO_E_FORMAT,
                      "%s: %s: %s of %llu bytes exceeds the limit of %zu bytes",
                      fn, path, what, (unsigned long long)size, limit);
  }
  size_t n = (size_t)size;
  char *buf = bico__alloc(ctx, n + 1);
  if (buf == NULL) {
    close(fd);
    return BICO_E_NOMEM;
  }
  int e = bico__pread_all(fd, buf, n, 0);
  close(fd);
  if (e != 0) {
    bico__free(ctx, buf);
    return bico__fail(ctx, BICO_E_IO, "%s: %s: read failed: %s", fn, path,
                      e == EIO ? "the file shrank while being read"
                               : strerror(e));
  }
  buf[n] = '\0';
  *out = buf;
  *len = n;
  return BICO_OK;
}
