// Robustness of the whole library in a serving process:
//  - failure paths never touch files they did not create (found by
//    `make leak-check`: bico_stwriter_create's allocation-failure path
//    unlinked an uninitialised temporary name);
//  - many threads, each with its own context, running whole transfers at
//    once give bit-identical outputs to a sequential run (also run under
//    ThreadSanitizer by `make tsan-check`).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bico/bico.h"
#include "bico/safetensors.h"
#include "bico/transfer.h"
#include "st_testutil.h"
#include "testutil.h"

namespace {

// Each allocation is pre-filled with the path of an innocent file, as
// reused heap memory may well be, and each allocation in turn fails; the
// file must survive.
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

using Spec = std::vector<std::pair<std::string, std::vector<size_t>>>;

void write_random(const std::string &path, const Spec &ts, double scale,
                  uint64_t seed) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK);
  for (auto &t : ts)
    ASSERT_EQ(bico_stwriter_declare(w, t.first.c_str(), BICO_DTYPE_F32,
                                    t.second.size(), t.second.data()),
              BICO_OK);
  bt::Rng g(seed);
  for (auto &t : ts) {
    size_t n = 1;
    for (size_t e : t.second) n *= e;
    std::vector<float> v = bt::randn(g, n, 1, scale).f32();
    ASSERT_EQ(bico_stwriter_write_f32(w, t.first.c_str(), v.data(), n), BICO_OK);
  }
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
}

// One whole BiCo transfer (calibration statistics, centering, Procrustes,
// transport, atomic write) with its own context.
bico_status transfer(const stt::TempDir &dir, const std::string &out,
                     std::string *err) {
  bico_ctx *ctx = nullptr;
  if (bico_ctx_create(&ctx) != BICO_OK) return BICO_E_NOMEM;
  bico_transfer *t = nullptr;
  bico_status st = bico_transfer_create(ctx, &t);
  const std::pair<int, std::string> files[] = {
      {BICO_FILE_SOURCE_BASE, dir / "A.safetensors"},
      {BICO_FILE_TASK_VECTOR, dir / "tau.safetensors"},
      {BICO_FILE_TARGET_BASE, dir / "B.safetensors"},
      {BICO_FILE_SOURCE_CALIB, dir / "calA.safetensors"},
      {BICO_FILE_TARGET_CALIB, dir / "calB.safetensors"},
      {BICO_FILE_OUTPUT, out}};
  for (auto &f : files)
    if (st == BICO_OK) st = bico_transfer_set_file(t, f.first, f.second.c_str());
  if (st == BICO_OK) st = bico_transfer_set_param(t, BICO_TRANSFER_CENTER, 1);
  if (st == BICO_OK) st = bico_transfer_run(t);
  if (st != BICO_OK) *err = bico_ctx_errmsg(ctx);
  bico_transfer_free(t);
  bico_ctx_free(ctx);
  return st;
}

TEST(RobustThreads, ConcurrentTransfersMatchASequentialRunBitForBit) {
  stt::TempDir dir;
  const size_t d_a = 12, d_b = 16, rows = 64, blocks = 3;
  Spec pa, pb, ca, cb;
  for (size_t i = 0; i < blocks; i++) {
    std::string m = "blocks." + std::to_string(i) + ".fc";
    pa.push_back({m + ".weight", {d_a, d_a}});
    pa.push_back({m + ".bias", {d_a}});
    pb.push_back({m + ".weight", {d_b, d_b}});
    pb.push_back({m + ".bias", {d_b}});
    ca.push_back({m + ".input", {rows, d_a}});
    ca.push_back({m + ".output_grad", {rows, d_a}});
    cb.push_back({m + ".input", {rows, d_b}});
    cb.push_back({m + ".output_grad", {rows, d_b}});
  }
  write_random(dir / "A.safetensors", pa, 1.0, 1);
  write_random(dir / "tau.safetensors", pa, 0.1, 2);
  write_random(dir / "B.safetensors", pb, 1.0, 3);
  write_random(dir / "calA.safetensors", ca, 1.0, 4);
  write_random(dir / "calB.safetensors", cb, 1.0, 5);

  std::string err;
  ASSERT_EQ(transfer(dir, dir / "seq.safetensors", &err), BICO_OK) << err;
  const std::string want = stt::read_bytes(dir / "seq.safetensors");
  ASSERT_GT(want.size(), 0u);

  const int nthreads = 8, runs = 3;
  std::vector<std::string> errs(nthreads);
  std::vector<int> failures(nthreads, 0);
  std::vector<std::thread> pool;
  for (int k = 0; k < nthreads; k++)
    pool.emplace_back([&, k] {
      for (int r = 0; r < runs; r++) {
        std::string out = dir / ("t" + std::to_string(k) + "_" +
                                 std::to_string(r) + ".safetensors");
        if (transfer(dir, out, &errs[k]) != BICO_OK) failures[k]++;
      }
    });
  for (auto &th : pool) th.join();
  for (int k = 0; k < nthreads; k++) {
    EXPECT_EQ(failures[k], 0) << "thread " << k << ": " << errs[k];
    for (int r = 0; r < runs; r++) {
      std::string out = dir / ("t" + std::to_string(k) + "_" +
                               std::to_string(r) + ".safetensors");
      EXPECT_TRUE(stt::read_bytes(out) == want)
          << "thread " << k << " run " << r << " differs from the sequential run";
    }
  }
}

}  // namespace
