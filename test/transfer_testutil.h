// Helpers shared by the transfer suites that build small checkpoints on
// disk (test_transfer_check.cc, test_transfer_checks.cc): named float32
// tensors written to a safetensors file by libbico's writer.
#ifndef BICO_TRANSFER_TESTUTIL_H
#define BICO_TRANSFER_TESTUTIL_H

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

namespace ttu {

// A float32 tensor: its name, shape and values (row-major).
struct Named {
  std::string name;
  std::vector<size_t> shape;
  std::vector<float> v;
};

// n copies of x.
inline std::vector<float> filled(size_t n, float x) {
  return std::vector<float>(n, x);
}

// The tensors of f, as F32, in a safetensors file at path (committed).
inline void write_f32(const std::string &path, const std::vector<Named> &f) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK);
  for (auto &e : f)
    ASSERT_EQ(bico_stwriter_declare(w, e.name.c_str(), BICO_DTYPE_F32,
                                    e.shape.size(), e.shape.data()),
              BICO_OK);
  for (auto &e : f)
    ASSERT_EQ(bico_stwriter_write_f32(w, e.name.c_str(), e.v.data(), e.v.size()),
              BICO_OK);
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
}

}  // namespace ttu

#endif
