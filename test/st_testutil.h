// Helpers shared by the safetensors and JSON suites: temporary folders,
// whole-file I/O, and hand-built safetensors files (so the reader is tested
// against bytes the test composed itself, not against libbico's writer).
#ifndef BICO_ST_TESTUTIL_H
#define BICO_ST_TESTUTIL_H

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "bico/bico.h"

namespace stt {

// A fresh folder under $TMPDIR (or /tmp), removed with its contents.
struct TempDir {
  std::string path;
  TempDir() {
    const char *t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/bico-st-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) != nullptr) path = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
  std::string operator/(const std::string &name) const {
    return path + "/" + name;
  }
  // Names in the folder (not recursive), sorted.
  std::vector<std::string> list() const {
    std::vector<std::string> v;
    for (auto &e : std::filesystem::directory_iterator(path))
      v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }
};

inline std::string read_bytes(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

inline void write_bytes(const std::string &path, const std::string &bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), (std::streamsize)bytes.size());
}

inline std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int k = 0; k < 8; k++) s[k] = (char)((v >> (8 * k)) & 0xff);
  return s;
}

// A safetensors file from a header text (padded with spaces to 8) and data.
inline std::string st_bytes(const std::string &header,
                            const std::string &data = "") {
  std::string h = header;
  while (h.size() % 8) h += ' ';
  return le64(h.size()) + h + data;
}

inline std::string f32_bytes(const std::vector<float> &v) {
  std::string s(v.size() * 4, '\0');
  for (size_t i = 0; i < v.size(); i++) {
    uint32_t b;
    std::memcpy(&b, &v[i], 4);
    for (int k = 0; k < 4; k++) s[4 * i + k] = (char)((b >> (8 * k)) & 0xff);
  }
  return s;
}

// RAII owners of the handles.
struct File {
  bico_stfile *f = nullptr;
  ~File() { bico_stfile_free(f); }
  operator bico_stfile *() const { return f; }
};

struct Writer {
  bico_stwriter *w = nullptr;
  ~Writer() { bico_stwriter_free(w); }
  operator bico_stwriter *() const { return w; }
};

inline bool contains(const std::string &hay, const std::string &needle) {
  return hay.find(needle) != std::string::npos;
}

}  // namespace stt

#endif
