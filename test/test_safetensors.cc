// safetensors reader, writer and sharded index, through the public API.
//
// Expected values come from outside the library: IEEE half/bfloat16
// rounding re-implemented here on float bit patterns (a different algorithm
// from the library's), hand-picked values whose encodings follow from the
// IEEE definitions, files whose bytes the test composes itself, and the
// malformed corpus in test/data/malformed (test/data/make_malformed.py).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "st_testutil.h"
#include "testutil.h"

using stt::contains;
using stt::TempDir;

namespace {

// ---- independent conversions (float bit manipulation) ----

uint32_t fbits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float bitsf(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// v >> s rounded to nearest, ties to even (s >= 1).
uint32_t round_shift(uint32_t v, int s) {
  if (s >= 32) return 0;
  uint32_t q = v >> s, rem = v & ((1u << s) - 1), half = 1u << (s - 1);
  if (rem > half || (rem == half && (q & 1))) q++;
  return q;
}

uint16_t ref_f16(float f) {
  uint32_t x = fbits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  uint32_t fe = (x >> 23) & 0xff, m = x & 0x7fffff;
  if (fe == 0xff) return (uint16_t)(sign | (m ? 0x7e00 : 0x7c00));
  if (fe == 0) return sign;  // float zero/subnormal: far below half's range
  int e = (int)fe - 127;     // unbiased
  uint32_t full = m | 0x800000;  // 24 significant bits
  if (e >= -14) {                // half normal range
    uint32_t q = round_shift(full, 13);  // 11 bits incl. the implicit one
    int he = e + 15;
    if (q == 0x800) {
      q = 0x400;
      he++;
    }
    if (he >= 31) return (uint16_t)(sign | 0x7c00);
    return (uint16_t)(sign | (he << 10) | (q & 0x3ff));
  }
  // half subnormal: units of 2^-24; value = full * 2^(e-23)
  int shift = -e - 1;
  if (shift >= 25) return sign;
  return (uint16_t)(sign | round_shift(full, shift));
}

uint16_t ref_bf16(float f) {
  uint32_t x = fbits(f);
  if ((x & 0x7f800000) == 0x7f800000 && (x & 0x7fffff))
    return (uint16_t)((x >> 16) | 0x40);
  return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

float ref_f16_value(uint16_t h) {
  int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float s = (h & 0x8000) ? -1.0f : 1.0f;
  if (e == 31) return m ? std::numeric_limits<float>::quiet_NaN()
                        : s * std::numeric_limits<float>::infinity();
  if (e == 0) return s * std::ldexp((float)m, -24);
  return s * std::ldexp((float)(1024 + m), e - 25);
}

uint16_t le16_at(const void *p, size_t i) {
  const unsigned char *b = (const unsigned char *)p + 2 * i;
  return (uint16_t)(b[0] | (b[1] << 8));
}

std::string errmsg(bico_ctx *ctx) { return bico_ctx_errmsg(ctx); }

bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return fbits(a) == fbits(b);
}

// The float values every conversion test uses: IEEE corner cases plus
// random floats of all magnitudes.
std::vector<float> conversion_values(bool f16_range) {
  std::vector<float> v = {
      0.0f, -0.0f, 1.0f, -1.0f, 0.5f, 3.140625f,
      1.0f + std::ldexp(1.0f, -11),      // half tie: to 1.0
      1.0f + 3 * std::ldexp(1.0f, -11),  // half tie: up to 1 + 2^-9
      1.0f + std::ldexp(1.0f, -8),       // bf16 tie: to 1.0
      1.0f + 3 * std::ldexp(1.0f, -8),   // bf16 tie: up
      65504.0f, 65519.0f, -65504.0f,     // half max, rounds down to max
      std::ldexp(1.0f, -14),             // half min normal
      std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25),  // tie into normal
      std::ldexp(1.0f, -24),             // half min subnormal
      std::ldexp(1.0f, -25),             // tie: to zero
      1.5f * std::ldexp(1.0f, -25),      // above tie: min subnormal
      3 * std::ldexp(1.0f, -25),         // tie: to 2 * 2^-24 (even)
      std::ldexp(1.0f, -30), 1e-40f,     // below half / float subnormal
      std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::quiet_NaN()};
  bt::Rng g(7);
  for (int i = 0; i < 2000; i++) {
    float x = (float)(g.normal() * std::ldexp(1.0, (int)(g.next() % 60) - 40));
    if (f16_range && std::fabs(x) >= 65504.0f) continue;
    v.push_back(x);
  }
  if (!f16_range)
    for (float x : {1e30f, -3e38f, std::numeric_limits<float>::denorm_min()})
      v.push_back(x);
  return v;
}

}  // namespace

TEST(SafetensorsDtype, NamesSizesAndFrozenValues) {
  struct {
    int d;
    const char *name;
    size_t size;
    int frozen;
  } rows[] = {{BICO_DTYPE_F32, "F32", 4, 1},   {BICO_DTYPE_F16, "F16", 2, 2},
              {BICO_DTYPE_BF16, "BF16", 2, 3}, {BICO_DTYPE_F64, "F64", 8, 4},
              {BICO_DTYPE_I8, "I8", 1, 5},     {BICO_DTYPE_I16, "I16", 2, 6},
              {BICO_DTYPE_I32, "I32", 4, 7},   {BICO_DTYPE_I64, "I64", 8, 8},
              {BICO_DTYPE_U8, "U8", 1, 9},     {BICO_DTYPE_U16, "U16", 2, 10},
              {BICO_DTYPE_U32, "U32", 4, 11},  {BICO_DTYPE_U64, "U64", 8, 12},
              {BICO_DTYPE_BOOL, "BOOL", 1, 13}};
  for (auto &r : rows) {
    EXPECT_EQ(r.d, r.frozen);
    EXPECT_STREQ(bico_dtype_name(r.d), r.name);
    EXPECT_EQ(bico_dtype_size(r.d), r.size);
    int back = 0;
    EXPECT_EQ(bico_dtype_from_name(r.name, &back), BICO_OK);
    EXPECT_EQ(back, r.d);
  }
  int d;
  EXPECT_EQ(bico_dtype_name(0), nullptr);
  EXPECT_EQ(bico_dtype_name(14), nullptr);
  EXPECT_EQ(bico_dtype_size(-1), 0u);
  EXPECT_EQ(bico_dtype_from_name("f32", &d), BICO_E_NOTFOUND);
  EXPECT_EQ(bico_dtype_from_name(nullptr, &d), BICO_E_NULL);
}

// The one float predicate: exactly the dtypes whose safetensors name is an
// IEEE or brain float ("F..", "BF.."), nothing outside the enumeration.
TEST(SafetensorsDtype, IsFloatExactlyTheFloatingPointNames) {
  int nfloat = 0;
  for (int d = -2; d < 40; d++) {
    const char *n = bico_dtype_name(d);
    const bool fl = n != nullptr && (n[0] == 'F' || (n[0] == 'B' && n[1] == 'F'));
    EXPECT_EQ(bico_dtype_is_float(d), fl ? 1 : 0) << d;
    nfloat += fl;
  }
  EXPECT_EQ(nfloat, 4);
}

TEST(SafetensorsRoundTrip, HandPickedEncodings) {
  // Bit patterns that follow from the IEEE definitions alone.
  struct {
    float x;
    uint16_t f16, bf16;
  } rows[] = {
      {1.0f, 0x3c00, 0x3f80},
      {-2.0f, 0xc000, 0xc000},
      {1.0f + std::ldexp(1.0f, -11), 0x3c00, 0x3f80},      // half tie: even
      {1.0f + 3 * std::ldexp(1.0f, -11), 0x3c02, 0x3f80},  // half tie: up
      {1.0f + std::ldexp(1.0f, -8), 0x3c04, 0x3f80},       // bf16 tie: even
      {1.0f + 3 * std::ldexp(1.0f, -8), 0x3c0c, 0x3f82},   // bf16 tie: up
      {65504.0f, 0x7bff, 0x4780},
      {std::ldexp(1.0f, -24), 0x0001, 0x3380},
      {std::ldexp(1.0f, -25), 0x0000, 0x3300},
      {3 * std::ldexp(1.0f, -25), 0x0002, 0x33c0},
      {std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25), 0x0400, 0x3880},
  };
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "h.safetensors";
  stt::Writer w;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
  size_t n = sizeof rows / sizeof rows[0];
  std::vector<float> x;
  for (auto &r : rows) x.push_back(r.x);
  ASSERT_EQ(bico_stwriter_declare(w, "h", BICO_DTYPE_F16, 1, &n), BICO_OK);
  ASSERT_EQ(bico_stwriter_declare(w, "b", BICO_DTYPE_BF16, 1, &n), BICO_OK);
  ASSERT_EQ(bico_stwriter_write_f32(w, "h", x.data(), n), BICO_OK) << errmsg(ctx);
  ASSERT_EQ(bico_stwriter_write_f32(w, "b", x.data(), n), BICO_OK) << errmsg(ctx);
  ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << errmsg(ctx);
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK) << errmsg(ctx);
  // bico_stfile_data's bytes live until the next call: copy the first.
  const void *hp0, *bp;
  size_t hn, bn;
  ASSERT_EQ(bico_stfile_data(f, 0, &hp0, &hn), BICO_OK);
  std::vector<unsigned char> hcopy((const unsigned char *)hp0,
                                   (const unsigned char *)hp0 + hn);
  const void *hp = hcopy.data();
  ASSERT_EQ(bico_stfile_data(f, 1, &bp, &bn), BICO_OK);
  ASSERT_EQ(hn, 2 * n);
  ASSERT_EQ(bn, 2 * n);
  for (size_t i = 0; i < n; i++) {
    EXPECT_EQ(le16_at(hp, i), rows[i].f16) << "F16 of " << rows[i].x;
    EXPECT_EQ(le16_at(bp, i), rows[i].bf16) << "BF16 of " << rows[i].x;
  }
}

TEST(SafetensorsRoundTrip, EveryFloatDtypeAgainstIndependentRounding) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "rt.safetensors";
  std::vector<float> wide = conversion_values(false);
  std::vector<float> narrow = conversion_values(true);
  {
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
    size_t nw = wide.size(), nn = narrow.size();
    ASSERT_EQ(bico_stwriter_declare(w, "f32", BICO_DTYPE_F32, 1, &nw), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "f16", BICO_DTYPE_F16, 1, &nn), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "bf16", BICO_DTYPE_BF16, 1, &nw), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "f64", BICO_DTYPE_F64, 1, &nw), BICO_OK);
    // any order of writes
    ASSERT_EQ(bico_stwriter_write_f32(w, "f64", wide.data(), nw), BICO_OK);
    ASSERT_EQ(bico_stwriter_write_f32(w, "bf16", wide.data(), nw), BICO_OK) << errmsg(ctx);
    ASSERT_EQ(bico_stwriter_write_f32(w, "f16", narrow.data(), nn), BICO_OK) << errmsg(ctx);
    ASSERT_EQ(bico_stwriter_write_f32(w, "f32", wide.data(), nw), BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << errmsg(ctx);
  }
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK) << errmsg(ctx);
  ASSERT_EQ(bt::count(bico_stfile_count, f), 4u);
  std::map<std::string, int> want = {{"f32", BICO_DTYPE_F32},
                                     {"f16", BICO_DTYPE_F16},
                                     {"bf16", BICO_DTYPE_BF16},
                                     {"f64", BICO_DTYPE_F64}};
  for (auto &kv : want) {
    size_t idx;
    ASSERT_EQ(bico_stfile_find(f, kv.first.c_str(), &idx), BICO_OK);
    const char *name;
    int dtype;
    size_t ndim;
    const size_t *shape;
    ASSERT_EQ(bico_stfile_tensor_info(f, idx, &name, &dtype, &ndim, &shape),
              BICO_OK);
    EXPECT_EQ(std::string(name), kv.first);
    EXPECT_EQ(dtype, kv.second);
    ASSERT_EQ(ndim, 1u);
    const std::vector<float> &src = kv.first == "f16" ? narrow : wide;
    ASSERT_EQ(shape[0], src.size());
    std::vector<float> got(src.size());
    ASSERT_EQ(bico_stfile_read_f32(f, idx, got.data(), got.size()), BICO_OK);
    std::vector<double> got64(src.size());
    ASSERT_EQ(bico_stfile_read_f64(f, idx, got64.data(), got64.size()), BICO_OK);
    const void *raw;
    size_t nbytes;
    ASSERT_EQ(bico_stfile_data(f, idx, &raw, &nbytes), BICO_OK);
    for (size_t i = 0; i < src.size(); i++) {
      float expect = src[i];
      if (kv.second == BICO_DTYPE_F16) {
        uint16_t h = ref_f16(src[i]);
        if (!std::isnan(src[i])) {
          ASSERT_EQ(le16_at(raw, i), h) << src[i];
        }
        expect = ref_f16_value(h);
      } else if (kv.second == BICO_DTYPE_BF16) {
        uint16_t b = ref_bf16(src[i]);
        if (!std::isnan(src[i])) {
          ASSERT_EQ(le16_at(raw, i), b) << src[i];
        }
        expect = bitsf((uint32_t)b << 16);
      }
      ASSERT_TRUE(same_float(got[i], expect))
          << kv.first << "[" << i << "] of " << src[i] << ": " << got[i]
          << " vs " << expect;
      ASSERT_TRUE(same_float((float)got64[i], expect)) << kv.first << i;
    }
  }
}

TEST(SafetensorsRoundTrip, F64SourceRoundsOnceNotTwice) {
  // 1 + 2^-11 + 2^-40 lies just above a half tie; via float it would land
  // exactly on the tie (2^-40 is below float's ulp) and round to 1.0.
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "d.safetensors";
  std::vector<double> x = {1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40),
                           1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40),
                           0.1, 1.0 / 3.0};
  size_t n = x.size();
  {
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "h", BICO_DTYPE_F16, 1, &n), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "b", BICO_DTYPE_BF16, 1, &n), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "s", BICO_DTYPE_F32, 1, &n), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "d", BICO_DTYPE_F64, 1, &n), BICO_OK);
    for (const char *t : {"h", "b", "s", "d"})
      ASSERT_EQ(bico_stwriter_write_f64(w, t, x.data(), n), BICO_OK) << t;
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
  }
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK) << errmsg(ctx);
  const void *p;
  size_t nb;
  ASSERT_EQ(bico_stfile_data(f, 0, &p, &nb), BICO_OK);
  EXPECT_EQ(le16_at(p, 0), 0x3c01);
  ASSERT_EQ(bico_stfile_data(f, 1, &p, &nb), BICO_OK);
  EXPECT_EQ(le16_at(p, 1), 0x3f81);
  std::vector<float> s(n);
  std::vector<double> d(n);
  ASSERT_EQ(bico_stfile_read_f32(f, 2, s.data(), n), BICO_OK);
  ASSERT_EQ(bico_stfile_read_f64(f, 3, d.data(), n), BICO_OK);
  for (size_t i = 0; i < n; i++) {
    EXPECT_EQ(s[i], (float)x[i]);  // in range: C's conversion is RNE
    EXPECT_EQ(d[i], x[i]);
  }
}

TEST(SafetensorsRoundTrip, IntegerDtypesReadAsNumbers) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "i.safetensors";
  int8_t i8[] = {-128, -1, 0, 127};
  int16_t i16[] = {-32768, -2, 3, 32767};
  int32_t i32[] = {INT32_MIN, -5, 7, INT32_MAX};
  int64_t i64[] = {-((int64_t)1 << 53), -9, 11, (int64_t)1 << 53};
  uint8_t u8[] = {0, 1, 200, 255};
  uint16_t u16[] = {0, 1, 60000, 65535};
  uint32_t u32[] = {0, 1, 4000000000u, 16777216u};
  uint64_t u64[] = {0, 1, (uint64_t)1 << 60, 12345};
  uint8_t bl[] = {0, 1, 0, 1};
  struct {
    const char *name;
    int dtype;
    const void *data;
    size_t nbytes;
    double v[4];
  } rows[] = {
      {"i8", BICO_DTYPE_I8, i8, sizeof i8, {-128, -1, 0, 127}},
      {"i16", BICO_DTYPE_I16, i16, sizeof i16, {-32768, -2, 3, 32767}},
      {"i32", BICO_DTYPE_I32, i32, sizeof i32, {(double)INT32_MIN, -5, 7, (double)INT32_MAX}},
      {"i64", BICO_DTYPE_I64, i64, sizeof i64, {-9007199254740992.0, -9, 11, 9007199254740992.0}},
      {"u8", BICO_DTYPE_U8, u8, sizeof u8, {0, 1, 200, 255}},
      {"u16", BICO_DTYPE_U16, u16, sizeof u16, {0, 1, 60000, 65535}},
      {"u32", BICO_DTYPE_U32, u32, sizeof u32, {0, 1, 4000000000.0, 16777216}},
      {"u64", BICO_DTYPE_U64, u64, sizeof u64, {0, 1, 1152921504606846976.0, 12345}},
      {"bool", BICO_DTYPE_BOOL, bl, sizeof bl, {0, 1, 0, 1}},
  };
  // The test host is little-endian (x86-64): the arrays are the file bytes.
  size_t four = 4;
  {
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
    for (auto &r : rows)
      ASSERT_EQ(bico_stwriter_declare(w, r.name, r.dtype, 1, &four), BICO_OK);
    for (auto &r : rows) {
      float dummy[4] = {0, 0, 0, 0};
      EXPECT_EQ(bico_stwriter_write_f32(w, r.name, dummy, 4), BICO_E_ARG);
      EXPECT_TRUE(contains(errmsg(ctx), "write_raw")) << errmsg(ctx);
      ASSERT_EQ(bico_stwriter_write_raw(w, r.name, r.data, r.nbytes), BICO_OK);
    }
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
  }
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK) << errmsg(ctx);
  for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
    double d[4];
    float s[4];
    ASSERT_EQ(bico_stfile_read_f64(f, k, d, 4), BICO_OK);
    ASSERT_EQ(bico_stfile_read_f32(f, k, s, 4), BICO_OK);
    for (int i = 0; i < 4; i++) {
      EXPECT_EQ(d[i], rows[k].v[i]) << rows[k].name << i;
      EXPECT_EQ(s[i], (float)rows[k].v[i]) << rows[k].name << i;
    }
    EXPECT_EQ(bico_stfile_check_finite(f, k), BICO_OK);
  }
}

TEST(SafetensorsRoundTrip, MetadataZeroSizeAndScalars) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "m.safetensors";
  const char *keys[] = {"format", "quote\"back\\slash", "ctrl\n\t\x01",
                        "\xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80", "empty"};
  const char *vals[] = {"pt", "a\"b\\c/d", "line1\nline2\r\x1f",
                        "\xe2\x82\xac", ""};
  size_t z1[] = {0, 3}, z2[] = {5, 0};
  {
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
    for (int k = 0; k < 5; k++)
      ASSERT_EQ(bico_stwriter_add_metadata(w, keys[k], vals[k]), BICO_OK);
    EXPECT_EQ(bico_stwriter_add_metadata(w, "format", "x"), BICO_E_ARG);
    EXPECT_TRUE(contains(errmsg(ctx), "'format' added twice")) << errmsg(ctx);
    ASSERT_EQ(bico_stwriter_declare(w, "z1", BICO_DTYPE_F32, 2, z1), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "scalar", BICO_DTYPE_F64, 0, nullptr), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "z2", BICO_DTYPE_BF16, 2, z2), BICO_OK);
    double pi = 3.25;
    ASSERT_EQ(bico_stwriter_write_f64(w, "scalar", &pi, 1), BICO_OK);
    ASSERT_EQ(bico_stwriter_write_f32(w, "z1", nullptr, 0), BICO_OK);
    // z2 (zero bytes) left unwritten: nothing to write, commit accepts it
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << errmsg(ctx);
  }
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK) << errmsg(ctx);
  ASSERT_EQ(bt::count(bico_stfile_metadata_count, f), 5u);
  for (size_t k = 0; k < 5; k++) {
    const char *key, *val;
    ASSERT_EQ(bico_stfile_metadata_at(f, k, &key, &val), BICO_OK);
    EXPECT_STREQ(key, keys[k]);
    EXPECT_STREQ(val, vals[k]);
    ASSERT_EQ(bico_stfile_metadata_get(f, keys[k], &val), BICO_OK);
    EXPECT_STREQ(val, vals[k]);
  }
  const char *v;
  EXPECT_EQ(bico_stfile_metadata_get(f, "nope", &v), BICO_E_NOTFOUND);
  EXPECT_TRUE(contains(errmsg(ctx), "'nope'"));
  EXPECT_EQ(bico_stfile_metadata_at(f, 5, nullptr, nullptr), BICO_E_ARG);
  ASSERT_EQ(bt::count(bico_stfile_count, f), 3u);
  size_t numel, nbytes, ndim;
  const size_t *shape;
  ASSERT_EQ(bico_stfile_tensor_size(f, 0, &numel, &nbytes), BICO_OK);
  EXPECT_EQ(numel, 0u);
  EXPECT_EQ(nbytes, 0u);
  ASSERT_EQ(bico_stfile_tensor_info(f, 0, nullptr, nullptr, &ndim, &shape), BICO_OK);
  ASSERT_EQ(ndim, 2u);
  EXPECT_EQ(shape[0], 0u);
  EXPECT_EQ(shape[1], 3u);
  EXPECT_EQ(bico_stfile_read_f32(f, 0, nullptr, 0), BICO_OK);
  ASSERT_EQ(bico_stfile_tensor_info(f, 1, nullptr, nullptr, &ndim, nullptr), BICO_OK);
  EXPECT_EQ(ndim, 0u);
  float s;
  ASSERT_EQ(bico_stfile_read_f32(f, 1, &s, 1), BICO_OK);
  EXPECT_EQ(s, 3.25f);
  ASSERT_EQ(bico_stfile_tensor_info(f, 2, nullptr, nullptr, &ndim, &shape), BICO_OK);
  EXPECT_EQ(shape[0], 5u);
  EXPECT_EQ(shape[1], 0u);
}

TEST(SafetensorsRoundTrip, HeaderPaddedAndLaidOutAsTheSpecSays) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "p.safetensors";
  std::vector<float> a = {1, 2, 3}, b = {4};
  for (int extra = 0; extra < 9; extra++) {  // name lengths shift the padding
    std::string name(1 + extra, 'n');
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
    size_t s3 = 3, s1 = 1;
    ASSERT_EQ(bico_stwriter_declare(w, name.c_str(), BICO_DTYPE_F32, 1, &s3), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "b", BICO_DTYPE_F32, 1, &s1), BICO_OK);
    ASSERT_EQ(bico_stwriter_write_f32(w, "b", b.data(), 1), BICO_OK);
    ASSERT_EQ(bico_stwriter_write_f32(w, name.c_str(), a.data(), 3), BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
    std::string bytes = stt::read_bytes(path);
    ASSERT_GE(bytes.size(), 8u);
    uint64_t n = 0;
    for (int k = 7; k >= 0; k--) n = (n << 8) | (unsigned char)bytes[k];
    EXPECT_EQ(n % 8, 0u);
    ASSERT_EQ(bytes.size(), 8 + n + 16);
    EXPECT_EQ(bytes[8], '{');
    std::string header = bytes.substr(8, n);
    size_t close = header.find_last_of('}');
    for (size_t k = close + 1; k < header.size(); k++) EXPECT_EQ(header[k], ' ');
    EXPECT_LT(header.size() - close - 1, 8u);
    // declaration order: a's floats first, then b's, little-endian
    EXPECT_EQ(bytes.substr(8 + n), stt::f32_bytes({1, 2, 3, 4}));
  }
}

TEST(SafetensorsRoundTrip, ThousandsOfTensorsFoundByName) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "many.safetensors";
  const size_t n = 3000;
  bt::Rng g(11);
  std::vector<size_t> rows(n);
  {
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
    for (size_t i = 0; i < n; i++) {
      rows[i] = 1 + g.next() % 4;
      size_t shape[2] = {rows[i], 2};
      std::string name = "blocks." + std::to_string(i) + ".w";
      ASSERT_EQ(bico_stwriter_declare(w, name.c_str(), BICO_DTYPE_F32, 2, shape), BICO_OK);
    }
    EXPECT_EQ(bico_stwriter_declare(w, "blocks.17.w", BICO_DTYPE_F32, 0, nullptr), BICO_E_ARG);
    EXPECT_TRUE(contains(errmsg(ctx), "'blocks.17.w' declared twice"));
    for (size_t k = 0; k < n; k++) {
      size_t i = (k * 7919) % n;  // a permutation of the write order
      std::vector<float> v(rows[i] * 2, (float)i);
      std::string name = "blocks." + std::to_string(i) + ".w";
      ASSERT_EQ(bico_stwriter_write_f32(w, name.c_str(), v.data(), v.size()), BICO_OK);
    }
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
  }
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK) << errmsg(ctx);
  ASSERT_EQ(bt::count(bico_stfile_count, f), n);
  for (size_t i = 0; i < n; i++) {
    std::string name = "blocks." + std::to_string(i) + ".w";
    size_t idx = n;
    ASSERT_EQ(bico_stfile_find(f, name.c_str(), &idx), BICO_OK);
    EXPECT_EQ(idx, i);  // header order = declaration order
    std::vector<float> v(rows[i] * 2);
    ASSERT_EQ(bico_stfile_read_f32(f, idx, v.data(), v.size()), BICO_OK);
    for (float x : v) ASSERT_EQ(x, (float)i);
  }
  size_t idx;
  EXPECT_EQ(bico_stfile_find(f, "blocks.3000.w", &idx), BICO_E_NOTFOUND);
  EXPECT_TRUE(contains(errmsg(ctx), "'blocks.3000.w'"));
  EXPECT_TRUE(contains(errmsg(ctx), path));
}

TEST(SafetensorsReader, ReadsFilesComposedByHand) {
  // Bytes composed here, in the spec's format, with non-declaration order
  // of offsets and an extra-spaces padded header.
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "hand.safetensors";
  std::string header =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}   ";
  stt::write_bytes(path, stt::st_bytes(header, stt::f32_bytes({1, 2, 3, 4, 5})));
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK) << errmsg(ctx);
  ASSERT_EQ(bt::count(bico_stfile_count, f), 2u);
  const char *name;
  ASSERT_EQ(bico_stfile_tensor_info(f, 0, &name, nullptr, nullptr, nullptr), BICO_OK);
  EXPECT_STREQ(name, "b");
  float b[2], a[3], part[2];
  ASSERT_EQ(bico_stfile_read_f32(f, 0, b, 2), BICO_OK);
  ASSERT_EQ(bico_stfile_read_f32(f, 1, a, 3), BICO_OK);
  EXPECT_EQ(b[0], 4);
  EXPECT_EQ(b[1], 5);
  EXPECT_EQ(a[0], 1);
  EXPECT_EQ(a[2], 3);
  ASSERT_EQ(bico_stfile_read_f32_range(f, 1, 1, part, 2), BICO_OK);
  EXPECT_EQ(part[0], 2);
  EXPECT_EQ(part[1], 3);
  double dpart[1];
  ASSERT_EQ(bico_stfile_read_f64_range(f, 1, 2, dpart, 1), BICO_OK);
  EXPECT_EQ(dpart[0], 3.0);
  EXPECT_EQ(bico_stfile_read_f32_range(f, 1, 2, part, 2), BICO_E_SHAPE);
  EXPECT_TRUE(contains(errmsg(ctx), "tensor 'a' has 3 elements")) << errmsg(ctx);
  EXPECT_EQ(bico_stfile_read_f32(f, 1, a, 2), BICO_E_SHAPE);
  EXPECT_EQ(bico_stfile_read_f32(f, 2, a, 3), BICO_E_ARG);
  EXPECT_TRUE(contains(errmsg(ctx), "index 2 out of range")) << errmsg(ctx);
  const char *p;
  ASSERT_EQ(bico_stfile_tensor_path(f, 0, &p), BICO_OK);
  EXPECT_EQ(std::string(p), path);
  EXPECT_EQ(bico_stfile_tensor_info(nullptr, 0, &name, nullptr, nullptr, nullptr),
            BICO_E_NULL);
  size_t n = 7;
  EXPECT_EQ(bico_stfile_count(nullptr, &n), BICO_E_NULL);
  EXPECT_EQ(n, 7u);
}

TEST(SafetensorsReader, NonFiniteDataIsReadAndReportedOnRequest) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "nf.safetensors";
  float nan = std::numeric_limits<float>::quiet_NaN();
  std::string header =
      "{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}";
  stt::write_bytes(path, stt::st_bytes(header, stt::f32_bytes({1, 2, nan})));
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK);
  float v[3];
  ASSERT_EQ(bico_stfile_read_f32(f, 0, v, 3), BICO_OK);
  EXPECT_TRUE(std::isnan(v[2]));
  EXPECT_EQ(bico_stfile_check_finite(f, 0), BICO_E_NONFINITE);
  std::string m = errmsg(ctx);
  EXPECT_TRUE(contains(m, "tensor 'x' holds NaN at element 2")) << m;
  EXPECT_TRUE(contains(m, path)) << m;
}

TEST(SafetensorsReader, OsErrorsNameTheFile) {
  bt::Ctx ctx;
  TempDir dir;
  bico_stfile *f = nullptr;
  std::string missing = dir / "missing.safetensors";
  EXPECT_EQ(bico_stfile_open(ctx, missing.c_str(), &f), BICO_E_IO);
  EXPECT_EQ(f, nullptr);
  EXPECT_TRUE(contains(errmsg(ctx), missing));
  EXPECT_TRUE(contains(errmsg(ctx), "No such file")) << errmsg(ctx);
  // A folder is a Hugging Face model folder (lib/io/modelpath.c): one holding
  // no checkpoint is NOTFOUND, naming what it looked for.
  EXPECT_EQ(bico_stfile_open(ctx, dir.path.c_str(), &f), BICO_E_NOTFOUND);
  EXPECT_TRUE(contains(errmsg(ctx), "without model.safetensors")) << errmsg(ctx);
  EXPECT_TRUE(contains(errmsg(ctx), dir.path)) << errmsg(ctx);
  // A FIFO is not a regular file (and does not block the open).
  std::string fifo = dir / "fifo.safetensors";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(bico_stfile_open(ctx, fifo.c_str(), &f), BICO_E_IO);
  EXPECT_TRUE(contains(errmsg(ctx), "not a regular file")) << errmsg(ctx);
  EXPECT_EQ(bico_stfile_open(ctx, nullptr, &f), BICO_E_NULL);
  EXPECT_EQ(bico_stfile_open(nullptr, missing.c_str(), &f), BICO_E_NULL);
  std::string empty = dir / "empty.safetensors";
  stt::write_bytes(empty, "");
  EXPECT_EQ(bico_stfile_open(ctx, empty.c_str(), &f), BICO_E_FORMAT);
  EXPECT_TRUE(contains(errmsg(ctx), "file is 0 bytes")) << errmsg(ctx);
}

// ---- the malformed corpus ----

namespace {
std::string corpus_dir() {
  const char *env = std::getenv("BICO_TEST_DATA");
  if (env && *env) return std::string(env) + "/malformed";
  std::string here = __FILE__;
  size_t slash = here.find_last_of('/');
  return (slash == std::string::npos ? std::string(".") : here.substr(0, slash)) +
         "/data/malformed";
}
}  // namespace

TEST(SafetensorsMalformed, EachFileRejectedWithItsOwnMessage) {
  struct Row {
    int status;
    const char *fragment;
    const char *tensor;  // "" when the problem is not a tensor's
  };
  const int F = BICO_E_FORMAT;
  std::map<std::string, Row> table = {
      {"truncated_short", {F, "file is 5 bytes, shorter than the 8-byte header length", ""}},
      {"truncated_data", {F, "data_offsets end 16 beyond the 8-byte data buffer (truncated file)", "a"}},
      {"header_too_long", {F, "header length 100000001 exceeds the limit of 100000000 bytes", ""}},
      {"header_beyond_file", {F, "header length 1000 exceeds the 16 bytes after the length field", ""}},
      {"header_bad_start", {F, "header does not begin with '{'", ""}},
      {"header_trailing_garbage", {F, "unexpected 'x' after the top-level value", ""}},
      {"offsets_overlap", {F, "data_offsets [4, 12] overlap tensor 'a' ending at 8", "b"}},
      {"offsets_gap", {F, "gap of 4 bytes in the data buffer before its data_offsets [12, 16]", "b"}},
      {"offsets_trailing_bytes", {F, "4 trailing bytes after the last tensor", ""}},
      {"offsets_not_integers", {F, "data_offsets must be two non-negative integers", "a"}},
      {"offsets_reversed", {F, "data_offsets [8, 0] end before begin", "a"}},
      {"unknown_dtype", {F, "unknown dtype 'F17'", "a"}},
      {"unsupported_dtype", {BICO_E_UNSUPPORTED, "dtype F8_E4M3 is not supported", "a"}},
      {"duplicate_name", {F, "at byte 58: duplicate key \"w\"", ""}},
      {"duplicate_name_escaped", {F, "at byte 63: duplicate key \"w\"", ""}},
      {"shape_size_mismatch", {F, "span 16 bytes but dtype F32 with 6 elements needs 24 (shape/size mismatch)", "a"}},
      {"shape_negative", {F, "shape entry 0 is negative", "a"}},
      {"shape_overflow", {F, "shape's byte size overflows", "a"}},
      {"shape_not_array", {F, "shape is not an array (integer)", "a"}},
      {"entry_unknown_key", {F, "unknown key 'foo' in its entry", "a"}},
      {"entry_missing_offsets", {F, "entry lacks 'data_offsets'", "a"}},
      {"entry_not_object", {F, "entry is not an object (array)", "a"}},
      {"name_with_nul", {F, "name holds a NUL byte", "a"}},
      {"metadata_nonstring", {F, "__metadata__ entry 'epochs' is not a string (integer)", ""}},
      {"metadata_not_object", {F, "__metadata__ is not an object (array)", ""}},
      {"json_trailing_comma", {F, "trailing comma before '}'", ""}},
      {"json_trailing_comma_array", {F, "trailing comma before ']'", ""}},
      {"json_bad_escape", {F, "bad escape \\x", ""}},
      {"json_short_unicode_escape", {F, "bad \\u escape (needs 4 hex digits)", ""}},
      {"json_lone_high_surrogate", {F, "unpaired high surrogate", ""}},
      {"json_lone_low_surrogate", {F, "unpaired low surrogate", ""}},
      {"json_invalid_utf8", {F, "invalid UTF-8: bad continuation byte", ""}},
      {"json_overlong_utf8", {F, "overlong UTF-8 encoding", ""}},
      {"json_raw_control", {F, "raw control byte 0x09 in a string", ""}},
      {"json_deep_nesting", {F, "nesting deeper than 64 levels", ""}},
      {"json_nan", {F, "NaN and Infinity are not JSON", ""}},
      {"json_leading_zero", {F, "number with a leading zero", ""}},
      {"json_int_overflow", {F, "integer out of the int64 range", ""}},
      {"json_unterminated", {F, "unterminated string", ""}},
      {"json_single_quotes", {F, "expected a string key, found '''", ""}},
      {"json_comment", {F, "expected a string key, found '/'", ""}},
  };
  std::string dir = corpus_dir();
  size_t seen = 0;
  std::map<std::string, std::string> messages;
  for (auto &e : std::filesystem::directory_iterator(dir)) {
    std::string file = e.path().filename().string();
    ASSERT_TRUE(file.size() > 12 && file.substr(file.size() - 12) == ".safetensors")
        << file;
    std::string stem = file.substr(0, file.size() - 12);
    auto it = table.find(stem);
    ASSERT_NE(it, table.end()) << "corpus file without an expectation: " << file;
    seen++;
    bt::Ctx ctx;
    bico_stfile *f = nullptr;
    std::string path = e.path().string();
    bico_status st = bico_stfile_open(ctx, path.c_str(), &f);
    EXPECT_EQ(st, it->second.status) << file << ": " << errmsg(ctx);
    EXPECT_EQ(f, nullptr);
    bico_stfile_free(f);
    std::string m = errmsg(ctx);
    EXPECT_TRUE(contains(m, it->second.fragment)) << file << ": " << m;
    EXPECT_TRUE(contains(m, path)) << file << " names no file: " << m;
    if (*it->second.tensor) {
      EXPECT_TRUE(contains(m, std::string("tensor '") + it->second.tensor + "'"))
          << file << ": " << m;
    }
    messages[m] = file;
  }
  EXPECT_EQ(seen, table.size()) << "expectations without a corpus file";
  EXPECT_EQ(messages.size(), seen) << "two files share a message";
}

// ---- writer: misuse and atomicity ----

TEST(SafetensorsWriter, MisuseIsRefusedWithClearMessages) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "w.safetensors";
  stt::Writer w;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
  size_t s2 = 2;
  EXPECT_EQ(bico_stwriter_declare(w, "__metadata__", BICO_DTYPE_F32, 1, &s2), BICO_E_ARG);
  EXPECT_TRUE(contains(errmsg(ctx), "reserved"));
  EXPECT_EQ(bico_stwriter_declare(w, "bad\xff", BICO_DTYPE_F32, 1, &s2), BICO_E_ARG);
  EXPECT_TRUE(contains(errmsg(ctx), "not valid UTF-8"));
  EXPECT_EQ(bico_stwriter_declare(w, "x", 99, 1, &s2), BICO_E_ARG);
  EXPECT_TRUE(contains(errmsg(ctx), "unknown dtype 99"));
  size_t huge[2] = {SIZE_MAX / 2, 4};
  EXPECT_EQ(bico_stwriter_declare(w, "x", BICO_DTYPE_F32, 2, huge), BICO_E_SHAPE);
  EXPECT_EQ(bico_stwriter_declare(w, "x", BICO_DTYPE_F32, 65, huge), BICO_E_SHAPE);
  EXPECT_EQ(bico_stwriter_declare(w, nullptr, BICO_DTYPE_F32, 1, &s2), BICO_E_NULL);
  EXPECT_EQ(bico_stwriter_declare(w, "x", BICO_DTYPE_F32, 1, nullptr), BICO_E_NULL);
  ASSERT_EQ(bico_stwriter_declare(w, "x", BICO_DTYPE_F16, 1, &s2), BICO_OK);
  ASSERT_EQ(bico_stwriter_declare(w, "y", BICO_DTYPE_F32, 1, &s2), BICO_OK);
  float ok[2] = {1, 2}, big[2] = {1, 70000};
  EXPECT_EQ(bico_stwriter_write_f32(w, "zz", ok, 2), BICO_E_NOTFOUND);
  EXPECT_TRUE(contains(errmsg(ctx), "tensor 'zz' was not declared"));
  EXPECT_EQ(bico_stwriter_write_f32(w, "x", ok, 3), BICO_E_SHAPE);
  EXPECT_TRUE(contains(errmsg(ctx), "tensor 'x' has 2 elements, count is 3"));
  EXPECT_EQ(bico_stwriter_write_f32(w, "x", big, 2), BICO_E_NONFINITE);
  EXPECT_TRUE(contains(errmsg(ctx), "tensor 'x': element 1 = 70000 overflows F16"))
      << errmsg(ctx);
  float tie[1] = {65520.0f};  // halfway to the next binade: rounds to Inf
  size_t one = 1;
  ASSERT_EQ(bico_stwriter_declare(w, "t", BICO_DTYPE_F16, 1, &one), BICO_OK);
  EXPECT_EQ(bico_stwriter_write_f32(w, "t", tie, 1), BICO_E_NONFINITE);
  float fmax[1] = {std::numeric_limits<float>::max()};  // above BF16's max
  ASSERT_EQ(bico_stwriter_declare(w, "bm", BICO_DTYPE_BF16, 1, &one), BICO_OK);
  EXPECT_EQ(bico_stwriter_write_f32(w, "bm", fmax, 1), BICO_E_NONFINITE);
  EXPECT_TRUE(contains(errmsg(ctx), "overflows BF16")) << errmsg(ctx);
  float bmax[1] = {bitsf(0x7f7f0000u)};
  EXPECT_EQ(bico_stwriter_write_f32(w, "bm", bmax, 1), BICO_OK);
  float inf[1] = {std::numeric_limits<float>::infinity()};
  EXPECT_EQ(bico_stwriter_write_f32(w, "t", inf, 1), BICO_OK);  // passed through
  EXPECT_EQ(bico_stwriter_write_raw(w, "y", ok, 7), BICO_E_SHAPE);
  EXPECT_TRUE(contains(errmsg(ctx), "needs 8 bytes, got 7"));
  EXPECT_EQ(bico_stwriter_write_f32(w, "x", ok, 2), BICO_OK);  // retry works
  EXPECT_EQ(bico_stwriter_write_f32(w, "x", ok, 2), BICO_E_STATE);
  EXPECT_TRUE(contains(errmsg(ctx), "already written"));
  EXPECT_EQ(bico_stwriter_declare(w, "late", BICO_DTYPE_F32, 1, &s2), BICO_E_STATE);
  EXPECT_EQ(bico_stwriter_add_metadata(w, "late", "v"), BICO_E_STATE);
  EXPECT_EQ(bico_stwriter_commit(w), BICO_E_STATE);
  EXPECT_TRUE(contains(errmsg(ctx), "tensor 'y' was declared but not written"));
  EXPECT_EQ(bico_stwriter_write_f32(w, "y", ok, 2), BICO_OK);
  EXPECT_EQ(bico_stwriter_commit(w), BICO_OK) << errmsg(ctx);
  EXPECT_EQ(bico_stwriter_commit(w), BICO_E_STATE);
  EXPECT_EQ(bico_stwriter_write_f32(w, "y", ok, 2), BICO_E_STATE);
  EXPECT_EQ(bico_stwriter_commit(nullptr), BICO_E_NULL);
  bico_stwriter_free(nullptr);
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK) << errmsg(ctx);
  EXPECT_EQ(bt::count(bico_stfile_count, f), 4u);
}

TEST(SafetensorsWriter, FailedOrAbandonedWritesLeaveTheOldFileAlone) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "out.safetensors";
  std::string old = "precious bytes that must survive";
  for (int mode = 0; mode < 3; mode++) {
    stt::write_bytes(path, old);
    {
      stt::Writer w;
      ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
      // the temporary file is in the same folder, recognisably named
      std::vector<std::string> names = dir.list();
      ASSERT_EQ(names.size(), 2u);
      EXPECT_EQ(names[0].rfind(".out.safetensors.bico-tmp.", 0), 0u) << names[0];
      size_t s = 4;
      ASSERT_EQ(bico_stwriter_declare(w, "a", BICO_DTYPE_F32, 1, &s), BICO_OK);
      float v[4] = {1, 2, 3, 4};
      if (mode == 0) {
        EXPECT_EQ(bico_stwriter_write_f32(w, "a", v, 3), BICO_E_SHAPE);
      } else if (mode == 1) {
        ASSERT_EQ(bico_stwriter_write_f32(w, "a", v, 4), BICO_OK);  // no commit
      } else {
        EXPECT_EQ(bico_stwriter_commit(w), BICO_E_STATE);  // a is missing
      }
      EXPECT_EQ(stt::read_bytes(path), old);
    }
    EXPECT_EQ(stt::read_bytes(path), old) << "mode " << mode;
    EXPECT_EQ(dir.list(), std::vector<std::string>{"out.safetensors"}) << mode;
  }
}

TEST(SafetensorsWriter, RefusesDirectoriesAndMissingFolders) {
  bt::Ctx ctx;
  TempDir dir;
  bico_stwriter *w = nullptr;
  EXPECT_EQ(bico_stwriter_create(ctx, dir.path.c_str(), &w), BICO_E_ARG);
  EXPECT_TRUE(contains(errmsg(ctx), "is a directory")) << errmsg(ctx);
  EXPECT_EQ(w, nullptr);
  std::string trailing = dir.path + "/";
  EXPECT_EQ(bico_stwriter_create(ctx, trailing.c_str(), &w), BICO_E_ARG);
  std::string nodir = dir / "no/such/folder/x.safetensors";
  EXPECT_EQ(bico_stwriter_create(ctx, nodir.c_str(), &w), BICO_E_IO);
  EXPECT_TRUE(contains(errmsg(ctx), dir / "no/such/folder")) << errmsg(ctx);
  EXPECT_TRUE(contains(errmsg(ctx), "No such file or directory")) << errmsg(ctx);
  EXPECT_EQ(bico_stwriter_create(ctx, nullptr, &w), BICO_E_NULL);
  EXPECT_EQ(bico_stwriter_create(nullptr, "x", &w), BICO_E_NULL);
  EXPECT_EQ(dir.list(), std::vector<std::string>{});
}

TEST(SafetensorsWriter, FileSizeLimitGivesIoErrorAndKeepsOldFile) {
  // RLIMIT_FSIZE in a child process (SIGXFSZ ignored, as the header tells
  // callers to): the write fails with EFBIG, reported as BICO_E_IO.
  TempDir dir;
  std::string path = dir / "big.safetensors";
  std::string old = "old contents";
  stt::write_bytes(path, old);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {65536, 65536};
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(10);
    bico_ctx *ctx = nullptr;
    bico_ctx_create(&ctx);
    bico_stwriter *w = nullptr;
    if (bico_stwriter_create(ctx, path.c_str(), &w) != BICO_OK) _exit(11);
    size_t n = 1 << 20;
    if (bico_stwriter_declare(w, "big", BICO_DTYPE_F32, 1, &n) != BICO_OK) _exit(12);
    std::vector<float> v(n, 1.0f);
    bico_status st = bico_stwriter_write_f32(w, "big", v.data(), n);
    std::string m = bico_ctx_errmsg(ctx);
    bico_stwriter_free(w);
    bico_ctx_free(ctx);
    if (st != BICO_E_IO) _exit(13);
    if (!contains(m, "File too large") || !contains(m, path)) _exit(14);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(stt::read_bytes(path), old);
  EXPECT_EQ(dir.list(), std::vector<std::string>{"big.safetensors"});
}

TEST(SafetensorsWriter, FullDiskGivesIoErrorAndKeepsOldFile) {
  // A 64 KiB tmpfs mounted in a private mount namespace of a child process
  // (needs root; skipped where the sandbox forbids it).
  TempDir dir;
  std::string mnt = dir / "small";
  ASSERT_EQ(mkdir(mnt.c_str(), 0755), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (unshare(CLONE_NEWNS) != 0) _exit(77);
    if (mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) _exit(77);
    if (mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=64k") != 0) _exit(77);
    std::string path = mnt + "/out.safetensors";
    stt::write_bytes(path, "old");
    bico_ctx *ctx = nullptr;
    bico_ctx_create(&ctx);
    bico_stwriter *w = nullptr;
    if (bico_stwriter_create(ctx, path.c_str(), &w) != BICO_OK) _exit(11);
    size_t n = 100000;
    if (bico_stwriter_declare(w, "big", BICO_DTYPE_F32, 1, &n) != BICO_OK) _exit(12);
    std::vector<float> v(n, 1.0f);
    bico_status st = bico_stwriter_write_f32(w, "big", v.data(), n);
    std::string m = bico_ctx_errmsg(ctx);
    bico_stwriter_free(w);
    bico_ctx_free(ctx);
    if (st != BICO_E_IO) _exit(13);
    if (!contains(m, "No space left on device") || !contains(m, path)) _exit(14);
    if (stt::read_bytes(path) != "old") _exit(15);
    size_t entries = 0;
    for (auto &e : std::filesystem::directory_iterator(mnt)) entries += !e.path().empty();
    _exit(entries == 1 ? 0 : 16);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "cannot mount a private tmpfs here";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(SafetensorsWriter, CommitReplacesAndKeepsTheOldMode) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "m.safetensors";
  stt::write_bytes(path, "old");
  ASSERT_EQ(chmod(path.c_str(), 0640), 0);
  std::string fresh = dir / "fresh.safetensors";
  mode_t mask = umask(027);
  for (const std::string &p : {path, fresh}) {
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, p.c_str(), &w.w), BICO_OK);
    size_t one = 1;
    float x = 5;
    ASSERT_EQ(bico_stwriter_declare(w, "x", BICO_DTYPE_F32, 1, &one), BICO_OK);
    ASSERT_EQ(bico_stwriter_write_f32(w, "x", &x, 1), BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << errmsg(ctx);
  }
  umask(mask);
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  ASSERT_EQ(stat(fresh.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);  // 0666 less umask 027
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK);
  float x;
  ASSERT_EQ(bico_stfile_read_f32(f, 0, &x, 1), BICO_OK);
  EXPECT_EQ(x, 5);
  EXPECT_EQ(dir.list(), (std::vector<std::string>{"fresh.safetensors", "m.safetensors"}));
}

// ---- sharded checkpoints ----

namespace {
struct Shards {
  TempDir dir;
  std::string index;
  Shards(const std::string &index_json) {
    stt::write_bytes(dir / "s1.safetensors",
                     stt::st_bytes("{\"__metadata__\":{\"format\":\"pt\"},"
                                   "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                                   "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
                                   stt::f32_bytes({1, 2, 3})));
    stt::write_bytes(dir / "s2.safetensors",
                     stt::st_bytes("{\"c\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}",
                                   stt::f32_bytes({4, 5, 6, 7})));
    index = dir / "model.safetensors.index.json";
    stt::write_bytes(index, index_json);
  }
};
const char *kGoodIndex =
    "{\"metadata\": {\"total_size\": 28, \"note\": \"two shards\"},\n"
    " \"weight_map\": {\"a\": \"s1.safetensors\", \"c\": \"s2.safetensors\",\n"
    "                \"b\": \"s1.safetensors\"}}\n";
}  // namespace

TEST(SafetensorsSharded, IndexOpensAsOneModel) {
  bt::Ctx ctx;
  Shards s(kGoodIndex);
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, s.index.c_str(), &f.f), BICO_OK) << errmsg(ctx);
  ASSERT_EQ(bt::count(bico_stfile_count, f), 3u);
  const char *names[] = {"a", "b", "c"};  // shard order, then header order
  float expect[3][4] = {{1, 2}, {3}, {4, 5, 6, 7}};
  for (size_t i = 0; i < 3; i++) {
    size_t idx;
    ASSERT_EQ(bico_stfile_find(f, names[i], &idx), BICO_OK);
    EXPECT_EQ(idx, i);
    size_t numel;
    ASSERT_EQ(bico_stfile_tensor_size(f, idx, &numel, nullptr), BICO_OK);
    std::vector<float> v(numel);
    ASSERT_EQ(bico_stfile_read_f32(f, idx, v.data(), numel), BICO_OK);
    for (size_t k = 0; k < numel; k++) EXPECT_EQ(v[k], expect[i][k]);
    const char *p;
    ASSERT_EQ(bico_stfile_tensor_path(f, idx, &p), BICO_OK);
    EXPECT_EQ(std::string(p), s.dir / (i < 2 ? "s1.safetensors" : "s2.safetensors"));
  }
  const char *v;
  ASSERT_EQ(bico_stfile_metadata_get(f, "total_size", &v), BICO_OK);
  EXPECT_STREQ(v, "28");
  ASSERT_EQ(bico_stfile_metadata_get(f, "note", &v), BICO_OK);
  EXPECT_STREQ(v, "two shards");
  size_t idx;
  EXPECT_EQ(bico_stfile_find(f, "d", &idx), BICO_E_NOTFOUND);
  EXPECT_TRUE(contains(errmsg(ctx), s.index));
}

TEST(SafetensorsSharded, InconsistentIndexesAreRejectedNamingTheFiles) {
  struct {
    const char *index;
    int status;
    const char *fragment;
  } rows[] = {
      // a shard file that does not exist
      {"{\"weight_map\":{\"a\":\"s1.safetensors\",\"b\":\"s1.safetensors\","
       "\"c\":\"s3.safetensors\"}}",
       BICO_E_IO, "s3.safetensors: cannot open: No such file or directory"},
      // c is in s2, the map says s1
      {"{\"weight_map\":{\"a\":\"s1.safetensors\",\"b\":\"s1.safetensors\","
       "\"c\":\"s1.safetensors\",\"x\":\"s2.safetensors\"}}",
       BICO_E_FORMAT, "tensor 'c' is in shard 's2.safetensors' but the weight_map assigns it to 's1.safetensors'"},
      // the map lists d, which no shard holds
      {"{\"weight_map\":{\"a\":\"s1.safetensors\",\"b\":\"s1.safetensors\","
       "\"c\":\"s2.safetensors\",\"d\":\"s2.safetensors\"}}",
       BICO_E_FORMAT, "weight_map lists tensor 'd' in shard 's2.safetensors', which does not hold it"},
      // s1 holds b, which the map does not list
      {"{\"weight_map\":{\"a\":\"s1.safetensors\",\"c\":\"s2.safetensors\"}}",
       BICO_E_FORMAT, "shard 's1.safetensors' holds tensor 'b' that the weight_map does not list"},
      {"{\"weight_map\":{\"a\":\"../s1.safetensors\"}}", BICO_E_FORMAT,
       "names shard '../s1.safetensors', not a file in the index's folder"},
      {"{\"weight_map\":{\"a\":7}}", BICO_E_FORMAT,
       "weight_map entry for tensor 'a' is not a file name (integer)"},
      {"{\"metadata\":{}}", BICO_E_FORMAT, "index lacks a \"weight_map\" object"},
      {"{\"weight_map\":{},}", BICO_E_FORMAT, "trailing comma"},
  };
  for (auto &r : rows) {
    bt::Ctx ctx;
    Shards s(r.index);
    bico_stfile *f = nullptr;
    EXPECT_EQ(bico_stfile_open(ctx, s.index.c_str(), &f), r.status) << r.index;
    EXPECT_EQ(f, nullptr);
    std::string m = errmsg(ctx);
    EXPECT_TRUE(contains(m, r.fragment)) << m;
    EXPECT_TRUE(contains(m, s.index)) << m;
  }
  // A malformed shard is reported with the shard's path and the index's.
  bt::Ctx ctx;
  Shards s(kGoodIndex);
  stt::write_bytes(s.dir / "s2.safetensors", "tiny");
  bico_stfile *f = nullptr;
  EXPECT_EQ(bico_stfile_open(ctx, s.index.c_str(), &f), BICO_E_FORMAT);
  std::string m = errmsg(ctx);
  EXPECT_TRUE(contains(m, s.dir / "s2.safetensors: file is 4 bytes")) << m;
  EXPECT_TRUE(contains(m, s.index)) << m;
}

// ---- allocation failures: every path cleans up ----

namespace {
struct FailingAlloc {
  long left;  // allocations that still succeed
};
void *failing_alloc(void *opaque, size_t size) {
  FailingAlloc *fa = (FailingAlloc *)opaque;
  if (fa->left-- <= 0) return nullptr;
  return std::malloc(size);
}
void failing_free(void *, void *p) { std::free(p); }
}  // namespace

TEST(SafetensorsReader, AllocationFailuresAreCleanAtEveryStep) {
  TempDir dir;
  Shards s(kGoodIndex);
  std::string single = dir / "one.safetensors";
  {
    bt::Ctx ctx;
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, single.c_str(), &w.w), BICO_OK);
    ASSERT_EQ(bico_stwriter_add_metadata(w, "k", "v"), BICO_OK);
    size_t two = 2;
    float v[2] = {1, 2};
    for (int i = 0; i < 40; i++)
      ASSERT_EQ(bico_stwriter_declare(w, ("t" + std::to_string(i)).c_str(),
                                      BICO_DTYPE_F32, 1, &two), BICO_OK);
    for (int i = 0; i < 40; i++)
      ASSERT_EQ(bico_stwriter_write_f32(w, ("t" + std::to_string(i)).c_str(), v, 2),
                BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
  }
  for (const std::string &path : {single, s.index}) {
    bool done = false;
    for (long budget = 1; budget < 10000 && !done; budget++) {
      FailingAlloc fa = {budget};
      bico_ctx *ctx = nullptr;
      ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, failing_alloc, failing_free, &fa),
                BICO_OK);
      bico_stfile *f = nullptr;
      bico_status st = bico_stfile_open(ctx, path.c_str(), &f);
      if (st == BICO_OK) {
        done = true;
        EXPECT_GT(bt::count(bico_stfile_count, f), 0u);
      } else {
        EXPECT_EQ(st, BICO_E_NOMEM) << bico_ctx_errmsg(ctx);
        EXPECT_EQ(f, nullptr);
      }
      bico_stfile_free(f);
      bico_ctx_free(ctx);
    }
    EXPECT_TRUE(done);
  }
}

TEST(SafetensorsWriter, AllocationFailuresAreCleanAtEveryStep) {
  TempDir dir;
  std::string path = dir / "w.safetensors";
  bool done = false;
  for (long budget = 1; budget < 10000 && !done; budget++) {
    FailingAlloc fa = {budget};
    bico_ctx *ctx = nullptr;
    ASSERT_EQ(bico_ctx_create_with_allocator(&ctx, failing_alloc, failing_free, &fa),
              BICO_OK);
    bico_stwriter *w = nullptr;
    bico_status st = bico_stwriter_create(ctx, path.c_str(), &w);
    if (st == BICO_OK) st = bico_stwriter_add_metadata(w, "k", "v");
    for (int i = 0; i < 70 && st == BICO_OK; i++) {
      size_t two = 2;
      std::string n = "t" + std::to_string(i);
      st = bico_stwriter_declare(w, n.c_str(), BICO_DTYPE_F16, 1, &two);
    }
    for (int i = 0; i < 70 && st == BICO_OK; i++) {
      float v[2] = {1, 2};
      std::string n = "t" + std::to_string(i);
      st = bico_stwriter_write_f32(w, n.c_str(), v, 2);
    }
    if (st == BICO_OK) st = bico_stwriter_commit(w);
    if (st == BICO_OK)
      done = true;
    else
      EXPECT_EQ(st, BICO_E_NOMEM) << bico_ctx_errmsg(ctx);
    bico_stwriter_free(w);
    bico_ctx_free(ctx);
    if (!done) {
      EXPECT_EQ(dir.list(), std::vector<std::string>{});
    }
  }
  EXPECT_TRUE(done);
  bt::Ctx ctx;
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK);
  EXPECT_EQ(bt::count(bico_stfile_count, f), 70u);
}

// ---- robustness: mutated files never crash the reader ----

TEST(SafetensorsMalformed, RandomMutationsAreRejectedOrReadCleanly) {
  // Byte flips, truncations and header-length changes of a valid file: each
  // open either succeeds (and every tensor then reads) or fails with a
  // format-level status; under ASan/UBSan this also checks for overreads.
  bt::Ctx ctx;
  TempDir dir;
  std::string base = dir / "base.safetensors";
  {
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, base.c_str(), &w.w), BICO_OK);
    ASSERT_EQ(bico_stwriter_add_metadata(w, "format", "pt"), BICO_OK);
    size_t s1[2] = {3, 2}, s2[1] = {4}, s3[1] = {0};
    ASSERT_EQ(bico_stwriter_declare(w, "blocks.0.w", BICO_DTYPE_F32, 2, s1), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "blocks.0.b", BICO_DTYPE_BF16, 1, s2), BICO_OK);
    ASSERT_EQ(bico_stwriter_declare(w, "e", BICO_DTYPE_I64, 1, s3), BICO_OK);
    float v[6] = {1, 2, 3, 4, 5, 6};
    ASSERT_EQ(bico_stwriter_write_f32(w, "blocks.0.w", v, 6), BICO_OK);
    ASSERT_EQ(bico_stwriter_write_f32(w, "blocks.0.b", v, 4), BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK);
  }
  const std::string good = stt::read_bytes(base);
  bt::Rng g(2024);
  int accepted = 0;
  for (int trial = 0; trial < 3000; trial++) {
    // a new file each time: rewriting one in place waits for writeback
    std::string path = dir / ("m" + std::to_string(trial) + ".safetensors");
    std::string b = good;
    switch (trial % 4) {
      case 0:  // flip random bytes of the header
        for (int k = 0; k < 1 + (int)(g.next() % 3); k++)
          b[8 + g.next() % (b.size() - 8)] = (char)(g.next() & 0xff);
        break;
      case 1:  // structural characters
        for (int k = 0; k < 2; k++)
          b[8 + g.next() % (b.size() - 8)] = "{}[]\",:\\ 0-e"[g.next() % 13];
        break;
      case 2:  // truncate
        b.resize(g.next() % b.size());
        break;
      default:  // header length off by a little or a lot
        b[g.next() % 8] = (char)(g.next() & 0xff);
        break;
    }
    stt::write_bytes(path, b);
    bico_stfile *f = nullptr;
    bico_status st = bico_stfile_open(ctx, path.c_str(), &f);
    if (st == BICO_OK) {
      accepted++;
      for (size_t i = 0; i < bt::count(bico_stfile_count, f); i++) {
        size_t numel;
        ASSERT_EQ(bico_stfile_tensor_size(f, i, &numel, nullptr), BICO_OK);
        std::vector<double> out(numel);
        ASSERT_EQ(bico_stfile_read_f64(f, i, out.data(), numel), BICO_OK);
      }
      bico_stfile_free(f);
    } else {
      EXPECT_TRUE(st == BICO_E_FORMAT || st == BICO_E_UNSUPPORTED)
          << st << ": " << bico_ctx_errmsg(ctx);
      EXPECT_EQ(f, nullptr);
      EXPECT_TRUE(contains(bico_ctx_errmsg(ctx), path)) << bico_ctx_errmsg(ctx);
    }
    std::remove(path.c_str());
  }
  EXPECT_GT(accepted, 0);  // some flips hit data bytes or padding
  EXPECT_LT(accepted, 3000);
}

// ---- bico_stfile_check_unchanged ----
//
// A reader of a model a tensor at a time over a long run checks, before it
// commits what it computed, that every file is still the one it opened.
// The files are composed here byte by byte; times are set with utimensat,
// so that a change never hides in the file system's timestamp granularity.

namespace {

const std::string kHeader =
    "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";

// Sets path's modification time to sec (nanoseconds 0).
void set_mtime(const std::string &path, time_t sec) {
  struct timespec ts[2] = {{sec, 0}, {sec, 0}};
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), ts, 0), 0);
}

// Overwrites n bytes at offset off in place (no truncation).
void poke(const std::string &path, off_t off, const std::string &bytes) {
  int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(pwrite(fd, bytes.data(), bytes.size(), off), (ssize_t)bytes.size());
  close(fd);
}

// A one-tensor file last written long ago (mtime 1e9).
std::string old_file(const TempDir &d, const std::string &name) {
  std::string p = d / name;
  stt::write_bytes(p, stt::st_bytes(kHeader, stt::f32_bytes({1, 2})));
  set_mtime(p, 1000000000);
  return p;
}

// The check's status and message.
std::pair<bico_status, std::string> check(bico_ctx *ctx, const bico_stfile *f) {
  bico_status st = bico_stfile_check_unchanged(f);
  return {st, st == BICO_OK ? std::string() : std::string(bico_ctx_errmsg(ctx))};
}

}  // namespace

TEST(StfileUnchanged, AnUntouchedFileIsOkAndEveryChangeIsNamed) {
  TempDir d;
  bt::Ctx ctx;
  EXPECT_EQ(bico_stfile_check_unchanged(nullptr), BICO_E_NULL);
  const size_t data = 8 + ((kHeader.size() + 7) / 8) * 8;  // data's offset
  struct Case {
    const char *what;
    std::function<void(const std::string &)> change;
    const char *words;
  };
  const Case cases[] = {
      {"nothing", [](const std::string &) {}, nullptr},
      {"read again: unchanged",
       [](const std::string &p) { (void)stt::read_bytes(p); }, nullptr},
      {"rewritten in place, same size",
       [&](const std::string &p) {
         poke(p, (off_t)data, stt::f32_bytes({7}));
         set_mtime(p, 1000000001);
       },
       "its modification time"},
      {"data rewritten within the same second, mtime then put back",
       // unseen by design (the tensors' bytes are not read again): the
       // documented limit; the header and size are what they were
       [&](const std::string &p) {
         poke(p, (off_t)data, stt::f32_bytes({7}));
         set_mtime(p, 1000000000);
       },
       nullptr},
      {"truncated",
       [&](const std::string &p) { ASSERT_EQ(truncate(p.c_str(), (off_t)data + 4), 0); },
       "its size"},
      {"extended",
       [&](const std::string &p) {
         ASSERT_EQ(truncate(p.c_str(), (off_t)data + 16), 0);
         set_mtime(p, 1000000000);
       },
       "its size"},
      {"replaced by rename, same bytes and time",
       [&](const std::string &p) {
         std::string n = p + ".new";
         stt::write_bytes(n, stt::read_bytes(p));
         set_mtime(n, 1000000000);
         ASSERT_EQ(rename(n.c_str(), p.c_str()), 0);
       },
       "the file its name leads to"},
      {"removed",
       [&](const std::string &p) { ASSERT_EQ(unlink(p.c_str()), 0); },
       "replaced or removed"},
      {"header edited in place, mtime put back",
       [&](const std::string &p) {
         poke(p, 10, "b");  // tensor "a" is now "b": same length
         set_mtime(p, 1000000000);
       },
       "its header"},
  };
  int k = 0;
  for (const Case &c : cases) {
    SCOPED_TRACE(c.what);
    std::string p = old_file(d, "m" + std::to_string(k++) + ".safetensors");
    stt::File f;
    ASSERT_EQ(bico_stfile_open(ctx, p.c_str(), &f.f), BICO_OK) << bico_ctx_errmsg(ctx);
    c.change(p);
    auto r = check(ctx, f);
    if (c.words == nullptr) {
      EXPECT_EQ(r.first, BICO_OK) << r.second;
      continue;
    }
    EXPECT_EQ(r.first, BICO_E_IO);
    EXPECT_TRUE(contains(r.second, p)) << r.second;
    EXPECT_TRUE(contains(r.second, c.words)) << r.second;
    EXPECT_TRUE(contains(r.second, "changed while it was being read")) << r.second;
    EXPECT_TRUE(contains(r.second, "nothing was written")) << r.second;
  }
}

TEST(StfileUnchanged, AShardOfAnIndexIsNamed) {
  TempDir d;
  bt::Ctx ctx;
  std::string s1 = old_file(d, "model-00001-of-00002.safetensors");
  std::string s2 = d / "model-00002-of-00002.safetensors";
  stt::write_bytes(
      s2, stt::st_bytes("{\"c\":{\"dtype\":\"F32\",\"shape\":[1],"
                        "\"data_offsets\":[0,4]}}",
                        stt::f32_bytes({3})));
  set_mtime(s2, 1000000000);
  std::string idx = d / "model.safetensors.index.json";
  stt::write_bytes(idx, "{\"weight_map\": {\"a\": \"model-00001-of-00002."
                        "safetensors\", \"c\": \"model-00002-of-00002."
                        "safetensors\"}}");
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, idx.c_str(), &f.f), BICO_OK) << bico_ctx_errmsg(ctx);
  EXPECT_EQ(bico_stfile_check_unchanged(f), BICO_OK) << bico_ctx_errmsg(ctx);
  // the folder stands for the index too
  stt::File g;
  ASSERT_EQ(bico_stfile_open(ctx, d.path.c_str(), &g.f), BICO_OK) << bico_ctx_errmsg(ctx);
  // the second shard rewritten in place, its size kept
  std::string bytes = stt::read_bytes(s2);
  poke(s2, (off_t)bytes.size() - 4, stt::f32_bytes({9}));
  for (bico_stfile *h : {f.f, g.f}) {
    EXPECT_EQ(bico_stfile_check_unchanged(h), BICO_E_IO);
    std::string m = bico_ctx_errmsg(ctx);
    EXPECT_TRUE(contains(m, "model-00002-of-00002.safetensors changed while")) << m;
    EXPECT_FALSE(contains(m, "00001")) << m;
  }
  // a file of the folder the reader does not read (the index) is not its
  stt::write_bytes(idx, stt::read_bytes(idx) + " ");
  stt::File h;
  ASSERT_EQ(bico_stfile_open(ctx, s1.c_str(), &h.f), BICO_OK);
  EXPECT_EQ(bico_stfile_check_unchanged(h), BICO_OK) << bico_ctx_errmsg(ctx);
}
