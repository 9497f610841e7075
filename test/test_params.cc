// The option grammar of params.h, on every handle that has options: one
// status for every refused value (NaN, infinities, outside the bounds,
// not an integer where integers are asked for) and for an unknown
// parameter, a message that names the parameter by its lower-case name,
// and a refused value leaves the handle unchanged.  The accepted sets come
// from each handle's own bico_X_param_bounds, so the test holds for any
// parameter added later.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "bico/bico.h"
#include "testutil.h"

namespace {

struct Handle {
  std::string what;
  bico_ctx *ctx;
  std::function<bico_status(int, double)> set;
  std::function<bico_status(int, double *)> get;
  bico_status (*bounds)(int, double *, double *, unsigned *);
  const char *(*name)(int);
  bico_status (*from_name)(const char *, int *);
};

bool lower_case(const std::string &s) {
  for (char c : s)
    if (std::isupper(static_cast<unsigned char>(c))) return false;
  return !s.empty();
}

void check_grammar(const Handle &h) {
  int known = 0;
  for (int p = -2; p < 64; p++) {
    double lo, hi;
    unsigned fl;
    if (h.bounds(p, &lo, &hi, &fl) != BICO_OK) {
      // Unknown: refused with BICO_E_ARG by set and get.
      double v;
      EXPECT_EQ(h.set(p, 1.0), BICO_E_ARG) << h.what << " param " << p;
      EXPECT_EQ(h.get(p, &v), BICO_E_ARG) << h.what << " param " << p;
      EXPECT_EQ(h.name(p), nullptr) << h.what << " param " << p;
      continue;
    }
    known++;
    const char *nm = h.name(p);
    ASSERT_NE(nm, nullptr) << h.what << " param " << p;
    std::string name = nm;
    EXPECT_TRUE(lower_case(name)) << h.what << ": " << name;
    int back = -1;
    EXPECT_EQ(h.from_name(nm, &back), BICO_OK) << name;
    EXPECT_EQ(back, p) << name;
    std::vector<double> bad = {NAN, HUGE_VAL, -HUGE_VAL};
    if (std::isfinite(lo))
      bad.push_back((fl & BICO_PARAM_LO_OPEN) ? lo : std::nextafter(lo, -HUGE_VAL));
    if (std::isfinite(hi))
      bad.push_back((fl & BICO_PARAM_HI_OPEN) ? hi : std::nextafter(hi, HUGE_VAL));
    if ((fl & BICO_PARAM_INTEGER) && hi - lo >= 1) bad.push_back(lo + 0.5);
    double before = 0, after = 0;
    ASSERT_EQ(h.get(p, &before), BICO_OK) << name;
    for (double v : bad) {
      EXPECT_EQ(h.set(p, v), BICO_E_ARG) << h.what << ": " << name << " = " << v;
      std::string msg = bico_ctx_errmsg(h.ctx);
      // The parameter by its lower-case name, as "name = value".
      EXPECT_NE(msg.find(" " + name + " = "), std::string::npos) << msg;
      EXPECT_EQ(msg.find("BICO_"), std::string::npos) << msg;
      ASSERT_EQ(h.get(p, &after), BICO_OK) << name;
      EXPECT_TRUE(after == before || (std::isnan(after) && std::isnan(before)))
          << h.what << ": " << name << " changed by a refused " << v;
    }
  }
  EXPECT_GT(known, 0) << h.what;
  int p = 0;
  EXPECT_EQ(h.from_name("no_such_parameter", &p), BICO_E_NOTFOUND) << h.what;
}

}  // namespace

TEST(Params, EveryHandleRefusesAlikeAndNamesTheParameter) {
  bt::Ctx ctx;
  bico_fit *fit = nullptr;
  bico_xcov *xc = nullptr;
  bico_procrustes *pr = nullptr;
  bico_merge *mg = nullptr;
  bico_transfer *tr = nullptr;
  ASSERT_EQ(bico_fit_create(ctx, 3, 2, 0, &fit), BICO_OK);
  ASSERT_EQ(bico_xcov_create(ctx, 3, 2, 0, &xc), BICO_OK);
  ASSERT_EQ(bico_procrustes_create(ctx, &pr), BICO_OK);
  ASSERT_EQ(bico_merge_create(ctx, &mg), BICO_OK);
  ASSERT_EQ(bico_transfer_create(ctx, &tr), BICO_OK);
  bico_lora *lo = nullptr;
  ASSERT_EQ(bico_lora_create(ctx, &lo), BICO_OK);
  bico_ctx *c = ctx;
  const Handle hs[] = {
      {"ctx", c, [&](int p, double v) { return bico_ctx_set_param(c, p, v); },
       [&](int p, double *v) { return bico_ctx_get_param(c, p, v); },
       bico_ctx_param_bounds, bico_ctx_param_name, bico_ctx_param_from_name},
      {"fit", c, [&](int p, double v) { return bico_fit_set_param(fit, p, v); },
       [&](int p, double *v) { return bico_fit_get_param(fit, p, v); },
       bico_fit_param_bounds, bico_fit_param_name, bico_fit_param_from_name},
      {"xcov", c, [&](int p, double v) { return bico_xcov_set_param(xc, p, v); },
       [&](int p, double *v) { return bico_xcov_get_param(xc, p, v); },
       bico_xcov_param_bounds, bico_xcov_param_name, bico_xcov_param_from_name},
      {"procrustes", c,
       [&](int p, double v) { return bico_procrustes_set_param(pr, p, v); },
       [&](int p, double *v) { return bico_procrustes_get_param(pr, p, v); },
       bico_procrustes_param_bounds, bico_procrustes_param_name,
       bico_procrustes_param_from_name},
      {"merge", c, [&](int p, double v) { return bico_merge_set_param(mg, p, v); },
       [&](int p, double *v) { return bico_merge_get_param(mg, p, v); },
       bico_merge_param_bounds, bico_merge_param_name, bico_merge_param_from_name},
      {"transfer", c,
       [&](int p, double v) { return bico_transfer_set_param(tr, p, v); },
       [&](int p, double *v) { return bico_transfer_get_param(tr, p, v); },
       bico_transfer_param_bounds, bico_transfer_param_name,
       bico_transfer_param_from_name},
      {"lora", c, [&](int p, double v) { return bico_lora_set_param(lo, p, v); },
       [&](int p, double *v) { return bico_lora_get_param(lo, p, v); },
       bico_lora_param_bounds, bico_lora_param_name, bico_lora_param_from_name},
  };
  for (const Handle &h : hs) check_grammar(h);
  bico_lora_free(lo);
  bico_transfer_free(tr);
  bico_merge_free(mg);
  bico_procrustes_free(pr);
  bico_xcov_free(xc);
  bico_fit_free(fit);
}
