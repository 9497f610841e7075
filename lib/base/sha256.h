/* SHA-256 (FIPS 180-4), for fingerprints of model files (internal).
 * Streaming: init, any number of updates, final. */
#ifndef BICO_SHA256_H
#define BICO_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct bico__sha256 {
  uint32_t h[8];
  uint64_t bytes;      /* message length so far */
  unsigned char buf[64];
  size_t nbuf;
} bico__sha256;

void bico__sha256_init(bico__sha256 *s);
void bico__sha256_update(bico__sha256 *s, const void *data, size_t n);
/* The digest as 64 lowercase hexadecimal digits and a NUL. */
void bico__sha256_final_hex(bico__sha256 *s, char hex[65]);

#endif
