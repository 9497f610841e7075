// Streaming: bico_stwriter_write_f32_range/_f64_range, and the driver's
// row-streamed token tables (BICO_TRANSFER_ROW_CHUNK).  Expected values
// come from outside the code under test: a whole write's bytes for the
// range writes, and a planted rotation Q for the transfer (the target is
// the source with its hidden space rotated, so a token table's update is
// tau Q^T exactly).
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <string>
#include <unistd.h>
#include <vector>

#include "st_testutil.h"
#include "testutil.h"
#include "transfer_testutil.h"

namespace {

using bt::Mat;

bool exists(const std::string &p) { return access(p.c_str(), F_OK) == 0; }

double max_abs_diff(const Mat &a, const Mat &b) {
  double m = 0;
  for (size_t i = 0; i < a.v.size(); i++) m = std::max(m, std::fabs(a.v[i] - b.v[i]));
  return a.v.size() == b.v.size() ? m : INFINITY;
}

std::string whole_file(const std::string &path, int dtype,
                       const std::vector<float> &v, size_t rows,
                       size_t cols) {
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  size_t shape[2] = {rows, cols};
  EXPECT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK);
  EXPECT_EQ(bico_stwriter_declare(w, "t", dtype, 2, shape), BICO_OK);
  EXPECT_EQ(bico_stwriter_write_f32(w, "t", v.data(), v.size()), BICO_OK);
  EXPECT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
  return stt::read_bytes(path);
}

TEST(StWriterRange, PiecesGiveTheWholeWritesBytes) {
  stt::TempDir d;
  bt::Rng g(11);
  size_t rows = 37, cols = 5;
  Mat m = bt::randn(g, rows, cols);
  std::vector<float> v = m.f32();
  for (int dtype : {BICO_DTYPE_F32, BICO_DTYPE_BF16, BICO_DTYPE_F16}) {
    std::string want = whole_file(d.path + "/whole.st", dtype, v, rows, cols);
    for (size_t piece : {1, 7, 64, 185}) {
      bt::Ctx ctx;
      bico_stwriter *w = nullptr;
      size_t shape[2] = {rows, cols};
      std::string path = d.path + "/pieces.st";
      ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK);
      ASSERT_EQ(bico_stwriter_declare(w, "t", dtype, 2, shape), BICO_OK);
      std::vector<double> dv(v.begin(), v.end());
      for (size_t at = 0, k = 0; at < v.size(); k++) {
        size_t n = std::min(piece, v.size() - at);
        // alternate the float and double writers: same conversion
        bico_status st =
            k % 2 ? bico_stwriter_write_f64_range(w, "t", at, dv.data() + at, n)
                  : bico_stwriter_write_f32_range(w, "t", at, v.data() + at, n);
        ASSERT_EQ(st, BICO_OK) << bico_ctx_errmsg(ctx);
        at += n;
      }
      ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
      bico_stwriter_free(w);
      EXPECT_EQ(stt::read_bytes(path), want) << "dtype " << dtype << " piece " << piece;
    }
  }
}

TEST(StWriterRange, OutOfOrderGapsOverrunsAndEarlyCommitsAreRefused) {
  stt::TempDir d;
  bt::Ctx ctx;
  bico_stwriter *w = nullptr;
  size_t shape[1] = {10};
  std::string path = d.path + "/o.st";
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w), BICO_OK);
  ASSERT_EQ(bico_stwriter_declare(w, "t", BICO_DTYPE_F16, 1, shape), BICO_OK);
  std::vector<float> v(10, 1.5f);
  EXPECT_EQ(bico_stwriter_write_f32_range(w, "t", 2, v.data(), 3), BICO_E_STATE);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("next starts at element 0"), std::string::npos)
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_stwriter_write_f32_range(w, "t", 0, v.data(), 11), BICO_E_SHAPE);
  EXPECT_EQ(bico_stwriter_write_f32_range(w, "t", 0, nullptr, 3), BICO_E_NULL);
  EXPECT_EQ(bico_stwriter_write_f32_range(w, "nope", 0, v.data(), 3), BICO_E_NOTFOUND);
  EXPECT_EQ(bico_stwriter_write_f32_range(nullptr, "t", 0, v.data(), 3), BICO_E_NULL);
  ASSERT_EQ(bico_stwriter_write_f32_range(w, "t", 0, v.data(), 4), BICO_OK);
  // A piece that overflows F16 is refused and leaves the count where it
  // was: the same range written again with good data goes through.
  std::vector<float> big(3, 1e6f);
  EXPECT_EQ(bico_stwriter_write_f32_range(w, "t", 4, big.data(), 3), BICO_E_NONFINITE);
  EXPECT_NE(std::string(bico_ctx_errmsg(ctx)).find("element 4"), std::string::npos)
      << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_stwriter_commit(w), BICO_E_STATE);  // 4 of 10 written
  ASSERT_EQ(bico_stwriter_write_f32_range(w, "t", 4, v.data(), 3), BICO_OK);
  ASSERT_EQ(bico_stwriter_write_f32_range(w, "t", 7, v.data(), 0), BICO_OK);
  ASSERT_EQ(bico_stwriter_write_f32_range(w, "t", 7, v.data(), 3), BICO_OK);
  EXPECT_EQ(bico_stwriter_write_f32_range(w, "t", 10, v.data(), 1), BICO_E_STATE);  // written
  EXPECT_EQ(bico_stwriter_write_f32(w, "t", v.data(), 10), BICO_E_STATE);
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_stwriter_free(w);
  bico_stfile *f = nullptr;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f), BICO_OK);
  std::vector<float> back(10);
  ASSERT_EQ(bico_stfile_read_f32(f, 0, back.data(), 10), BICO_OK);
  for (float x : back) EXPECT_EQ(x, 1.5f);
  bico_stfile_free(f);
}

// A stem (outside the blocks, named "stem"), a token table tied to it
// (pos_embed, V rows), one block; B is A with its hidden space rotated by
// Q: stem_B = Q stem_A, pos_B = pos_A Q^T, fc_B = fc_A Q^T.
struct Tied {
  stt::TempDir d;
  size_t p = 4, dm = 6, V = 23, n = 48;
  Mat Q, tpos;
  std::string A, B, tau, calA, calB;
  Tied(double pos_scale = 0.1) {
    bt::Rng g(3);
    Mat S = bt::randn(g, dm, p), P = bt::randn(g, V, dm), F = bt::randn(g, dm, dm, 0.5);
    Q = bt::rand_orth(g, dm);
    Mat Qt = bt::transpose(Q);
    tpos = bt::randn(g, V, dm, pos_scale);
    Mat ts = bt::randn(g, dm, p, 0.1), tf = bt::randn(g, dm, dm, 0.1);
    Mat X = bt::randn(g, n, p), G = bt::randn(g, n, dm), H = bt::randn(g, n, dm),
        Z = bt::randn(g, n, dm);
    A = d.path + "/A.st"; B = d.path + "/B.st"; tau = d.path + "/tau.st";
    calA = d.path + "/calA.st"; calB = d.path + "/calB.st";
    ttu::write_mats(A, {{"pos_embed", P}, {"stem.weight", S}, {"blocks.0.fc.weight", F}});
    ttu::write_mats(tau, {{"pos_embed", tpos}, {"stem.weight", ts}, {"blocks.0.fc.weight", tf}});
    ttu::write_mats(B, {{"pos_embed", bt::matmul(P, Qt)},
              {"stem.weight", bt::matmul(Q, S)},
              {"blocks.0.fc.weight", bt::matmul(F, Qt)}});
    ttu::write_mats(calA, {{"stem.input", X}, {"stem.output_grad", G},
                 {"blocks.0.fc.input", H}, {"blocks.0.fc.output_grad", Z}});
    ttu::write_mats(calB, {{"stem.input", X}, {"stem.output_grad", bt::matmul(G, Qt)},
                 {"blocks.0.fc.input", bt::matmul(H, Qt)},
                 {"blocks.0.fc.output_grad", Z}});
  }
  bico_transfer *make(bico_ctx *ctx, const std::string &out, const std::string &delta,
                      double chunk) {
    bico_transfer *t = nullptr;
    EXPECT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
    bico_transfer_set_file(t, BICO_FILE_SOURCE_BASE, A.c_str());
    bico_transfer_set_file(t, BICO_FILE_TASK_VECTOR, tau.c_str());
    bico_transfer_set_file(t, BICO_FILE_TARGET_BASE, B.c_str());
    bico_transfer_set_file(t, BICO_FILE_SOURCE_CALIB, calA.c_str());
    bico_transfer_set_file(t, BICO_FILE_TARGET_CALIB, calB.c_str());
    bico_transfer_set_file(t, BICO_FILE_OUTPUT, out.c_str());
    if (!delta.empty()) bico_transfer_set_file(t, BICO_FILE_DELTA_OUTPUT, delta.c_str());
    EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ROW_CHUNK, chunk), BICO_OK);
    return t;
  }
};

TEST(TransferStream, TokenTablesStreamedInAnyPieceSizeCarryThePlantedUpdate) {
  Tied s;
  bt::Ctx ctx;
  Mat want = bt::matmul(s.tpos, bt::transpose(s.Q));  // tau_pos Q^T
  std::string first_out, first_delta;
  for (double chunk : {0.0, 1.0, 4.0, 22.0, 23.0, 1000.0}) {
    std::string out = s.d.path + "/out.st", delta = s.d.path + "/delta.st";
    bico_transfer *t = s.make(ctx, out, delta, chunk);
    ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
    bico_transfer_free(t);
    Mat got = ttu::read_mat(delta, "pos_embed", s.V, s.dm);
    EXPECT_LT(max_abs_diff(got, want), 1e-5) << "chunk " << chunk;
    Mat base = ttu::read_mat(s.B, "pos_embed", s.V, s.dm), full = ttu::read_mat(out, "pos_embed", s.V, s.dm);
    EXPECT_LT(max_abs_diff(full, bt::add(base, want)), 1e-5) << "chunk " << chunk;
    if (chunk == 0.0) {
      first_out = stt::read_bytes(out);
      first_delta = stt::read_bytes(delta);
    } else {  // the piece size changes nothing, to the bit
      EXPECT_EQ(stt::read_bytes(out), first_out) << "chunk " << chunk;
      EXPECT_EQ(stt::read_bytes(delta), first_delta) << "chunk " << chunk;
    }
  }
}

struct Keep {
  std::vector<float> upd;
  static bico_status fn(void *o, const bico_transfer_tensor *x) {
    if (std::string(x->name) == "pos_embed" && x->update)
      static_cast<Keep *>(o)->upd.assign(x->update, x->update + x->count);
    return BICO_OK;
  }
};

// A partial run hands the sink the whole tensor's update (no streaming):
// the same values as the streamed whole run's delta.
TEST(TransferStream, PartialRunsWholeUpdateEqualsTheStreamedOne) {
  Tied s;
  bt::Ctx ctx;
  std::string out = s.d.path + "/out.st", delta = s.d.path + "/delta.st";
  bico_transfer *t = s.make(ctx, out, delta, 5);
  ASSERT_EQ(bico_transfer_run(t), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_transfer_free(t);
  Keep k;
  bico_transfer *p = s.make(ctx, s.d.path + "/unused.st", "", 0);
  unsigned char sel[3] = {1, 1, 1};
  ASSERT_EQ(bico_transfer_set_partial(p, sel, 3, Keep::fn, &k), BICO_OK);
  ASSERT_EQ(bico_transfer_run(p), BICO_OK) << bico_ctx_errmsg(ctx);
  bico_transfer_free(p);
  ASSERT_EQ(k.upd.size(), s.V * s.dm);
  Mat streamed = ttu::read_mat(delta, "pos_embed", s.V, s.dm);
  EXPECT_LT(max_abs_diff(Mat::from(k.upd.data(), s.V, s.dm, s.dm), streamed), 1e-6);
}

// An update that overflows float32 in a later piece fails the run naming
// the tensor and the element; nothing is written.
TEST(TransferStream, AnOverflowInAPieceFailsTheRunAndWritesNothing) {
  Tied s(1e30);
  bt::Ctx ctx;
  std::string out = s.d.path + "/out.st";
  bico_transfer *t = s.make(ctx, out, "", 3);
  ASSERT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ALPHA, 1e20), BICO_OK);
  EXPECT_EQ(bico_transfer_run(t), BICO_E_NONFINITE);
  std::string msg = bico_ctx_errmsg(ctx);
  EXPECT_NE(msg.find("pos_embed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("element"), std::string::npos) << msg;
  bico_transfer_free(t);
  EXPECT_FALSE(exists(out));
}

TEST(TransferStream, RowChunkIsAnOrdinaryParameter) {
  bt::Ctx ctx;
  bico_transfer *t = nullptr;
  ASSERT_EQ(bico_transfer_create(ctx, &t), BICO_OK);
  double v = -1;
  EXPECT_EQ(bico_transfer_get_param(t, BICO_TRANSFER_ROW_CHUNK, &v), BICO_OK);
  EXPECT_EQ(v, 0.0);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ROW_CHUNK, -1), BICO_E_ARG);
  EXPECT_EQ(bico_transfer_set_param(t, BICO_TRANSFER_ROW_CHUNK, 2.5), BICO_E_ARG);
  EXPECT_STREQ(bico_transfer_param_name(BICO_TRANSFER_ROW_CHUNK), "row_chunk");
  bico_transfer_free(t);
}

}  // namespace
