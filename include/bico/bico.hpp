// libbico for C++17: a header-only wrapper over the C API (<bico/bico.h>).
//
// It adds no ABI of its own: every function here is inline and calls the
// C functions, so a program built against it links to libbico.so.1 as a C
// program does.  It gives three things:
//
//   - handles owned by std::unique_ptr with their free function
//     (bico::ctx_ptr, bico::xcov_ptr, ... bico::transfer_ptr), made by
//     bico::make<Ptr>(ctx, bico_X_create, args...);
//   - statuses as exceptions: bico::check(status, ctx) throws bico::error
//     (a std::runtime_error carrying the status and bico_ctx_errmsg);
//   - or, for code that does not use exceptions for control flow, an
//     expected-like bico::result<T>: bico::try_make and bico::attempt
//     return the value or the status and message, never throw.
//
//   auto ctx = bico::make_ctx();
//   auto xc = bico::make<bico::xcov_ptr>(ctx.get(), bico_xcov_create,
//                                        d_a, d_b, 0u);
//   bico::check(bico_xcov_add(xc.get(), n, xa, d_a, xb, d_b), ctx.get());
//
// The C rules hold unchanged (docs/api.md): a handle must be freed before
// its context (declare the context first: unique_ptrs are destroyed in
// reverse order), one context by one thread at a time, lent handles
// outlive their borrower.
#ifndef BICO_BICO_HPP
#define BICO_BICO_HPP

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bico.h"

namespace bico {

// A failed call: its status and the context's message at the time.
class error : public std::runtime_error {
 public:
  error(bico_status status, const std::string &message)
      : std::runtime_error(message), status_(status) {}
  bico_status status() const noexcept { return status_; }

 private:
  bico_status status_;
};

// The message of a failure on ctx (NULL ctx: the status's static text).
inline std::string message(bico_status status, const bico_ctx *ctx) {
  const char *m = ctx != nullptr ? bico_ctx_errmsg(ctx) : "";
  std::string text = bico_status_name(status) ? bico_status_name(status) : "?";
  return text + ": " + (m[0] != '\0' ? m : bico_strerror(status));
}

// Throws bico::error unless status is BICO_OK.
inline void check(bico_status status, const bico_ctx *ctx) {
  if (status != BICO_OK) throw error(status, message(status, ctx));
}

// The value of a call, or its status and message: std::expected's shape
// (C++23) in C++17.  value() throws bico::error when there is none.
template <class T>
class result {
 public:
  result(T value) : value_(std::move(value)), status_(BICO_OK) {}
  result(bico_status status, std::string message)
      : status_(status), message_(std::move(message)) {}
  bool ok() const noexcept { return status_ == BICO_OK; }
  explicit operator bool() const noexcept { return ok(); }
  bico_status status() const noexcept { return status_; }
  const std::string &message() const noexcept { return message_; }
  T &value() {
    if (!ok()) throw error(status_, message_);
    return *value_;
  }
  T *operator->() { return &value(); }

 private:
  std::optional<T> value_;
  bico_status status_;
  std::string message_;
};

// A call's status as a result (no value): ok() or the status and message.
struct done {};
inline result<done> attempt(bico_status status, const bico_ctx *ctx) {
  if (status == BICO_OK) return result<done>(done{});
  return result<done>(status, message(status, ctx));
}

// ---- Handles ----

// The deleter of a handle: its bico_X_free (which accepts NULL).
template <auto Free>
struct deleter {
  template <class T>
  void operator()(T *p) const noexcept {
    Free(p);
  }
};

using ctx_ptr = std::unique_ptr<bico_ctx, deleter<bico_ctx_free>>;
using xcov_ptr = std::unique_ptr<bico_xcov, deleter<bico_xcov_free>>;
using procrustes_ptr =
    std::unique_ptr<bico_procrustes, deleter<bico_procrustes_free>>;
using votes_ptr = std::unique_ptr<bico_votes, deleter<bico_votes_free>>;
using fit_ptr = std::unique_ptr<bico_fit, deleter<bico_fit_free>>;
using stfile_ptr = std::unique_ptr<bico_stfile, deleter<bico_stfile_free>>;
using stwriter_ptr =
    std::unique_ptr<bico_stwriter, deleter<bico_stwriter_free>>;
using model_ptr = std::unique_ptr<bico_model, deleter<bico_model_free>>;
using transfer_ptr =
    std::unique_ptr<bico_transfer, deleter<bico_transfer_free>>;
using stats_plan_ptr =
    std::unique_ptr<bico_stats_plan, deleter<bico_stats_plan_free>>;
using lora_ptr = std::unique_ptr<bico_lora, deleter<bico_lora_free>>;
using merge_ptr = std::unique_ptr<bico_merge, deleter<bico_merge_free>>;

// A context with malloc/free (throws bico::error when it cannot be made).
inline ctx_ptr make_ctx() {
  bico_ctx *c = nullptr;
  bico_status st = bico_ctx_create(&c);
  if (st != BICO_OK) throw error(st, message(st, nullptr));
  return ctx_ptr(c);
}

// A handle from its create or open function, whose last argument is the
// out-pointer: make<xcov_ptr>(ctx, bico_xcov_create, d_a, d_b, 0u).
template <class Ptr, class Create, class... Args>
Ptr make(bico_ctx *ctx, Create create, Args &&...args) {
  typename Ptr::pointer p = nullptr;
  check(create(ctx, std::forward<Args>(args)..., &p), ctx);
  return Ptr(p);
}

// The same without exceptions: the handle, or the status and message.
template <class Ptr, class Create, class... Args>
result<Ptr> try_make(bico_ctx *ctx, Create create, Args &&...args) {
  typename Ptr::pointer p = nullptr;
  bico_status st = create(ctx, std::forward<Args>(args)..., &p);
  if (st != BICO_OK) return result<Ptr>(st, message(st, ctx));
  return result<Ptr>(Ptr(p));
}

// Arrays of pointers are T *const * (docs/api.md): paths from strings.
inline std::vector<const char *> c_strings(const std::vector<std::string> &v) {
  std::vector<const char *> out;
  out.reserve(v.size());
  for (const auto &s : v) out.push_back(s.c_str());
  return out;
}

// The handles of a vector of owners, as the C calls that take arrays of
// handles want them (bico_transfer_set_xcov's bico_xcov *const *).
template <class Ptr>
std::vector<typename Ptr::pointer> raw(const std::vector<Ptr> &v) {
  std::vector<typename Ptr::pointer> out;
  out.reserve(v.size());
  for (const auto &p : v) out.push_back(p.get());
  return out;
}

}  // namespace bico

#endif
