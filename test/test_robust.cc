// Failure paths that must never touch files they did not create: found by
// `make leak-check` (valgrind saw bico_stwriter_create's allocation-failure
// path unlink an uninitialised temporary name).  Here every allocation is
// pre-filled with the path of an innocent file, as reused heap memory may
// well be, and each allocation in turn fails; the file must survive.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "bico/bico.h"
#include "bico/safetensors.h"
#include "st_testutil.h"

namespace {

struct StaleAllocator {
  std::string stale;  // what every fresh block holds
  long fail_at = -1;  // index of the allocation that fails (-1: none)
  long count = 0;
};

void *stale_alloc(void *opaque, size_t size) {
  auto *a = static_cast<StaleAllocator *>(opaque);
  if (a->count++ == a->fail_at) return nullptr;
  char *p = static_cast<char *>(std::malloc(size));
  if (p != nullptr && size > 0) {
    size_t n = std::min(size - 1, a->stale.size());
    std::memcpy(p, a->stale.data(), n);
    p[n] = '\0';
  }
  return p;
}

void stale_free(void *opaque, void *p) {
  (void)opaque;
  std::free(p);
}

TEST(RobustFailurePaths, WriterCreateNeverUnlinksWhatItDidNotCreate) {
  stt::TempDir dir;
  const std::string victim = dir / "victim.safetensors";
  const std::string out = dir / "out.safetensors";
  for (long k = 0; k < 12; k++) {
    SCOPED_TRACE("allocation " + std::to_string(k) + " fails");
    stt::write_bytes(victim, "precious");
    StaleAllocator a;
    a.stale = victim;
    a.fail_at = k;
    bico_ctx *ctx = nullptr;
    // Allocation 0 is the context itself.
    if (bico_ctx_create_with_allocator(&ctx, stale_alloc, stale_free, &a) !=
        BICO_OK) {
      EXPECT_EQ(k, 0);
      continue;
    }
    bico_stwriter *w = nullptr;
    bico_status st = bico_stwriter_create(ctx, out.c_str(), &w);
    if (st == BICO_OK) {
      const size_t shape[1] = {2};
      const float v[2] = {1.0f, 2.0f};
      st = bico_stwriter_declare(w, "t", BICO_DTYPE_F32, 1, shape);
      if (st == BICO_OK) st = bico_stwriter_write_f32(w, "t", v, 2);
      if (st == BICO_OK) st = bico_stwriter_commit(w);
      bico_stwriter_free(w);
    } else {
      EXPECT_EQ(st, BICO_E_NOMEM) << bico_ctx_errmsg(ctx);
      EXPECT_EQ(w, nullptr);
    }
    bico_ctx_free(ctx);
    EXPECT_EQ(stt::read_bytes(victim), "precious");
    for (auto &name : dir.list())
      EXPECT_EQ(name.find("bico-tmp"), std::string::npos) << name;
  }
}

}  // namespace
