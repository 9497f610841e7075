// Helpers shared by the suites that build small checkpoints on disk and
// read their outputs back (transfer, LoRA, merge, families, partial and
// streamed runs): float32 tensors written to a safetensors file by
// libbico's writer, and read back by its reader.
#ifndef BICO_TRANSFER_TESTUTIL_H
#define BICO_TRANSFER_TESTUTIL_H

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
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

// A tensor of a hand-made file: its shape and float32 values, and a file
// of them in order.
struct Tensor {
  std::vector<size_t> shape;
  std::vector<float> v;
};
using File = std::vector<std::pair<std::string, Tensor>>;

// m as a [r, c] tensor, or as a vector of r * c values.
inline Tensor as_matrix(const bt::Mat &m) { return Tensor{{m.r, m.c}, m.f32()}; }
inline Tensor as_vector(const bt::Mat &m) { return Tensor{{m.r * m.c}, m.f32()}; }

// f at path (committed): every tensor declared in order, then written; a
// tensor with no values is declared only (the writer's checks see it).
inline void write_file(const std::string &path, const File &f) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK) << bico_ctx_errmsg(ctx);
  for (auto &e : f)
    ASSERT_EQ(bico_stwriter_declare(w, e.first.c_str(), BICO_DTYPE_F32,
                                    e.second.shape.size(), e.second.shape.data()),
              BICO_OK);
  for (auto &e : f) {
    if (e.second.v.empty()) continue;
    ASSERT_EQ(bico_stwriter_write_f32(w, e.first.c_str(), e.second.v.data(),
                                      e.second.v.size()),
              BICO_OK);
  }
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
}

// Matrices by name at path, each [r, c]; columns_as_vectors: a matrix of
// one column is written as a vector (a bias).
inline void write_mats(const std::string &path,
                       const std::vector<std::pair<std::string, bt::Mat>> &f,
                       bool columns_as_vectors = false) {
  File out;
  for (auto &e : f)
    out.emplace_back(e.first, columns_as_vectors && e.second.c == 1
                                  ? as_vector(e.second)
                                  : as_matrix(e.second));
  write_file(path, out);
}

// Every tensor of the file at path, as float32, by name.
inline std::map<std::string, Tensor> read_file(const std::string &path) {
  bt::Ctx ctx;
  bico_stfile *f = nullptr;
  std::map<std::string, Tensor> out;
  EXPECT_EQ(bico_stfile_open(ctx, path.c_str(), &f), BICO_OK) << bico_ctx_errmsg(ctx);
  if (f == nullptr) return out;
  for (size_t i = 0; i < bt::count(bico_stfile_count, f); i++) {
    const char *name;
    size_t ndim, numel;
    const size_t *shape;
    bico_stfile_tensor_info(f, i, &name, nullptr, &ndim, &shape);
    bico_stfile_tensor_size(f, i, &numel, nullptr);
    Tensor t{std::vector<size_t>(shape, shape + ndim), std::vector<float>(numel)};
    EXPECT_EQ(bico_stfile_read_f32(f, i, t.v.data(), numel), BICO_OK);
    out[name] = t;
  }
  bico_stfile_free(f);
  return out;
}

// The tensor `name` of the file at path as an [r, c] matrix.
inline bt::Mat read_mat(const std::string &path, const std::string &name,
                        size_t r, size_t c) {
  bt::Ctx ctx;
  bico_stfile *f = nullptr;
  EXPECT_EQ(bico_stfile_open(ctx, path.c_str(), &f), BICO_OK) << path << ": "
                                                              << bico_ctx_errmsg(ctx);
  if (f == nullptr) return bt::Mat(r, c);
  size_t i = 0;
  EXPECT_EQ(bico_stfile_find(f, name.c_str(), &i), BICO_OK) << name;
  std::vector<float> v(r * c);
  EXPECT_EQ(bico_stfile_read_f32(f, i, v.data(), v.size()), BICO_OK);
  bico_stfile_free(f);
  return bt::Mat::from(v.data(), r, c, c);
}

}  // namespace ttu

#endif
