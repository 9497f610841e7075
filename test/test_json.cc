// The strict JSON reader and writer (lib/base/json.c) are internal, so they are
// tested here through the public safetensors API: headers the test composes
// byte by byte are either accepted (and their decoded strings compared with
// UTF-8 written out by hand) or rejected with a specific reason; the writer
// side is checked by round-tripping names and metadata full of characters
// that need escaping.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bico/bico.h"
#include "st_testutil.h"
#include "testutil.h"

using stt::contains;
using stt::TempDir;

namespace {

// Opens a file made of `header` (plus optional data); returns the status and
// leaves the message in *msg, the first tensor's name in *name.
bico_status open_header(const std::string &header, std::string *msg,
                        std::string *name = nullptr,
                        const std::string &data = "") {
  TempDir dir;
  std::string path = dir / "j.safetensors";
  stt::write_bytes(path, stt::st_bytes(header, data));
  bt::Ctx ctx;
  bico_stfile *f = nullptr;
  bico_status st = bico_stfile_open(ctx, path.c_str(), &f);
  *msg = bico_ctx_errmsg(ctx);
  if (st == BICO_OK && name != nullptr && bt::count(bico_stfile_count, f) > 0) {
    const char *n;
    bico_stfile_tensor_info(f, 0, &n, nullptr, nullptr, nullptr);
    *name = n;
  }
  bico_stfile_free(f);
  return st;
}

// A one-tensor header with the given (already JSON-encoded) name.
std::string one_tensor(const std::string &json_name) {
  return "{" + json_name +
         ":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}";
}

}  // namespace

TEST(Json, EscapesAndSurrogatePairsDecodeToUtf8) {
  struct {
    const char *json;
    const char *utf8;
  } rows[] = {
      {"\"plain\"", "plain"},
      {"\"q\\\"b\\\\s\\/\"", "q\"b\\s/"},
      {"\"\\b\\f\\n\\r\\t\"", "\b\f\n\r\t"},
      {"\"\\u0041\\u00e9\\u20AC\"", "A\xc3\xa9\xe2\x82\xac"},
      {"\"\\ud83d\\ude00\"", "\xf0\x9f\x98\x80"},           // U+1F600
      {"\"\\uDBFF\\uDFFF\"", "\xf4\x8f\xbf\xbf"},           // U+10FFFF
      {"\"raw \xf0\x9f\x98\x80 \xe2\x82\xac\"", "raw \xf0\x9f\x98\x80 \xe2\x82\xac"},
      {"\"\"", ""},
  };
  for (auto &r : rows) {
    std::string msg, name;
    ASSERT_EQ(open_header(one_tensor(r.json), &msg, &name), BICO_OK)
        << r.json << ": " << msg;
    EXPECT_EQ(name, std::string(r.utf8)) << r.json;
  }
}

TEST(Json, WhitespaceBetweenTokensIsAllowed) {
  std::string msg, name;
  std::string h =
      "{ \t\r\n\"a\" \n:\t{\"dtype\" : \"U8\" ,\r\n \"shape\":[ 0 ] , "
      "\"data_offsets\" : [ 0 , 0 ] } \n}\n\t\r ";
  EXPECT_EQ(open_header(h, &msg, &name), BICO_OK) << msg;
  EXPECT_EQ(name, "a");
  // but not other bytes that some parsers take for whitespace
  EXPECT_EQ(open_header("{\"a\"\x0b:1}", &msg), BICO_E_FORMAT);
  EXPECT_TRUE(contains(msg, "expected ':' after a key, found byte 0x0b")) << msg;
}

TEST(Json, NestingLimitIsExactly64Containers) {
  // root object + __metadata__ object + k arrays
  auto nested = [](int k) {
    return "{\"__metadata__\":{\"x\":" + std::string(k, '[') +
           std::string(k, ']') + "}}";
  };
  std::string msg;
  EXPECT_EQ(open_header(nested(62), &msg), BICO_E_FORMAT);
  // parsed fine; refused only because metadata must be strings
  EXPECT_TRUE(contains(msg, "__metadata__ entry 'x' is not a string (array)")) << msg;
  EXPECT_EQ(open_header(nested(63), &msg), BICO_E_FORMAT);
  EXPECT_TRUE(contains(msg, "nesting deeper than 64 levels")) << msg;
  // a very deep document does not exhaust the stack
  EXPECT_EQ(open_header(nested(100000), &msg), BICO_E_FORMAT);
  EXPECT_TRUE(contains(msg, "nesting deeper")) << msg;
}

TEST(Json, NumbersAreStrict) {
  auto shape = [](const std::string &num) {
    return "{\"a\":{\"dtype\":\"U8\",\"shape\":[" + num +
           "],\"data_offsets\":[0,0]}}";
  };
  struct {
    const char *num;
    const char *fragment;
  } rows[] = {
      {"9223372036854775807", "(shape/size mismatch)"},  // parses
      {"9223372036854775808", "integer out of the int64 range"},
      {"-9223372036854775808", "shape entry 0 is negative"},  // parses
      {"-9223372036854775809", "integer out of the int64 range"},
      {"1.5", "shape entry 0 is number"},
      {"1e2", "shape entry 0 is number"},
      {"1E+2", "shape entry 0 is number"},
      {"true", "shape entry 0 is boolean"},
      {"null", "shape entry 0 is null"},
      {"\"3\"", "shape entry 0 is string"},
      {"01", "number with a leading zero"},
      {"-", "'-' not followed by a digit"},
      {"1.", "no digit after the decimal point"},
      {".5", "expected a value, found '.'"},
      {"1e", "no digit in the exponent"},
      {"+1", "expected a value, found '+'"},
      {"Infinity", "NaN and Infinity are not JSON"},
      {"-Infinity", "NaN and Infinity are not JSON"},
      {"1e999", "number out of the double range"},
      {"tru", "expected a value, found 't'"},
      {"0x10", "expected ',' or ']', found 'x'"},
  };
  for (auto &r : rows) {
    std::string msg;
    EXPECT_EQ(open_header(shape(r.num), &msg), BICO_E_FORMAT) << r.num;
    EXPECT_TRUE(contains(msg, r.fragment)) << r.num << ": " << msg;
  }
  std::string msg, name;
  EXPECT_EQ(open_header(shape("-0"), &msg, &name), BICO_OK) << msg;  // -0 == 0
}

TEST(Json, StringsAreStrict) {
  struct {
    std::string json;
    const char *fragment;
  } rows[] = {
      {"\"a\xed\xa0\x80\"", "UTF-8-encoded surrogate"},
      {"\"a\xf4\x90\x80\x80\"", "UTF-8 code point above U+10FFFF"},
      {"\"a\x80\"", "stray continuation byte"},
      {"\"a\xe2\x82\"", "bad continuation byte"},
      {"\"a\xf8\x88\x80\x80\x80\"", "invalid UTF-8 lead byte"},
      {"\"a\xe0\x80\xaf\"", "overlong UTF-8 encoding"},
      {"\"a\\u00\"", "bad \\u escape"},
      {"\"a\\uD800\\u0041\"", "unpaired high surrogate"},
      {"\"a\\uD800\"", "unpaired high surrogate"},
      {"\"\\uDFFF\"", "unpaired low surrogate"},
      {"\"a\\'\"", "bad escape \\'"},
      {"\"a\x1f\"", "raw control byte 0x1f"},
      {"\"a\x7f\"", ""},  // DEL is allowed raw: no error expected
  };
  for (auto &r : rows) {
    std::string msg, name;
    bico_status st = open_header(one_tensor(r.json), &msg, &name);
    if (*r.fragment == '\0') {
      EXPECT_EQ(st, BICO_OK) << msg;
      continue;
    }
    EXPECT_EQ(st, BICO_E_FORMAT) << r.fragment;
    EXPECT_TRUE(contains(msg, r.fragment)) << r.fragment << ": " << msg;
    EXPECT_TRUE(contains(msg, "invalid JSON at byte ")) << msg;
  }
}

TEST(Json, StructureErrorsAndTheirPositions) {
  struct {
    const char *header;
    const char *fragment;
  } rows[] = {
      {"{\"a\":1,}", "invalid JSON at byte 7: trailing comma before '}'"},
      {"{\"a\"}", "invalid JSON at byte 4: expected ':' after a key, found '}'"},
      {"{\"a\":[1 2]}", "invalid JSON at byte 8: expected ',' or ']', found '2'"},
      {"{\"a\":1 \"b\":2}", "expected ',' or '}', found '\"'"},
      {"{\"a\":[1,,2]}", "invalid JSON at byte 8: expected a value, found ','"},
      {"{\"a\":", "unexpected end of input, expected a value"},
      {"{\"a\":1}}", "unexpected '}' after the top-level value"},
      {"{\"a\":1}{}", "unexpected '{' after the top-level value"},
      {"{1:2}", "expected a string key, found '1'"},
      {"{\"a", "unterminated string"},
  };
  for (auto &r : rows) {
    std::string msg;
    EXPECT_EQ(open_header(r.header, &msg), BICO_E_FORMAT) << r.header;
    EXPECT_TRUE(contains(msg, r.fragment)) << r.header << ": " << msg;
  }
}

TEST(Json, DuplicateKeysFoundInSmallAndLargeObjects) {
  // small objects are checked pairwise, large ones after sorting: both
  for (int n : {3, 17, 2000}) {
    std::string h = "{\"__metadata__\":{";
    for (int i = 0; i < n; i++)
      h += "\"k" + std::to_string(i) + "\":\"v\",";
    h += "\"k" + std::to_string(n / 2) + "\":\"again\"}}";
    std::string msg;
    EXPECT_EQ(open_header(h, &msg), BICO_E_FORMAT) << n;
    EXPECT_TRUE(contains(msg, "duplicate key \"k" + std::to_string(n / 2) + "\""))
        << n << ": " << msg;
    // the same without the repeat is fine
    h = "{\"__metadata__\":{";
    for (int i = 0; i < n; i++)
      h += std::string(i ? "," : "") + "\"k" + std::to_string(i) + "\":\"v\"";
    h += "}}";
    EXPECT_EQ(open_header(h, &msg), BICO_OK) << n << ": " << msg;
  }
  // keys differing only after an escaped NUL are different keys
  std::string msg;
  EXPECT_EQ(open_header("{\"__metadata__\":{\"a\":\"1\",\"a\\u0000\":\"2\"}}", &msg),
            BICO_E_FORMAT);
  EXPECT_TRUE(contains(msg, "holds a NUL byte")) << msg;
}

TEST(Json, EmptyHeaderObjectIsAValidEmptyFile) {
  std::string msg;
  EXPECT_EQ(open_header("{}", &msg), BICO_OK) << msg;
  EXPECT_EQ(open_header("{}", &msg, nullptr, "x"), BICO_E_FORMAT);
  EXPECT_TRUE(contains(msg, "1 trailing bytes after the header of a file with no tensors"))
      << msg;
}

TEST(Json, WriterEscapesEverythingTheReaderDecodes) {
  // Every byte 0x01..0x7f plus multi-byte characters, in a tensor name and
  // in metadata: what comes back must be byte-identical.
  std::string all;
  for (int c = 1; c < 128; c++) all += (char)c;
  all += "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "esc.safetensors";
  {
    stt::Writer w;
    ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
    ASSERT_EQ(bico_stwriter_add_metadata(w, all.c_str(), all.c_str()), BICO_OK);
    size_t zero = 0;
    ASSERT_EQ(bico_stwriter_declare(w, all.c_str(), BICO_DTYPE_F32, 1, &zero), BICO_OK);
    ASSERT_EQ(bico_stwriter_commit(w), BICO_OK) << bico_ctx_errmsg(ctx);
  }
  std::string bytes = stt::read_bytes(path);
  // no raw control bytes in the header: all were escaped
  for (size_t k = 8; k < bytes.size(); k++)
    EXPECT_GE((unsigned char)bytes[k], 0x20u) << "byte " << k;
  stt::File f;
  ASSERT_EQ(bico_stfile_open(ctx, path.c_str(), &f.f), BICO_OK) << bico_ctx_errmsg(ctx);
  const char *name, *key, *val;
  ASSERT_EQ(bico_stfile_tensor_info(f, 0, &name, nullptr, nullptr, nullptr), BICO_OK);
  EXPECT_EQ(std::string(name), all);
  ASSERT_EQ(bico_stfile_metadata_at(f, 0, &key, &val), BICO_OK);
  EXPECT_EQ(std::string(key), all);
  EXPECT_EQ(std::string(val), all);
}

TEST(Json, MetadataRejectsInvalidUtf8OnWrite) {
  bt::Ctx ctx;
  TempDir dir;
  std::string path = dir / "u.safetensors";
  stt::Writer w;
  ASSERT_EQ(bico_stwriter_create(ctx, path.c_str(), &w.w), BICO_OK);
  EXPECT_EQ(bico_stwriter_add_metadata(w, "k", "\xc3"), BICO_E_ARG);
  EXPECT_TRUE(contains(bico_ctx_errmsg(ctx), "not valid UTF-8"));
  EXPECT_EQ(bico_stwriter_add_metadata(w, "\xed\xa0\x80", "v"), BICO_E_ARG);
}
