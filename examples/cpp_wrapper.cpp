// libbico from C++17 through <bico/bico.hpp>: handles owned by unique_ptr,
// failures as exceptions (bico::error) or as values (bico::result).
//
// The task: recover a planted rotation between two point clouds (as
// hello.c does in C), then meet two failures -- one as an exception, one
// as a result -- and see that the handles are freed on every path.
#include <bico/bico.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  try {
    auto ctx = bico::make_ctx();  // declared first: freed last
    const size_t n = 50, d = 3;
    // x_b = x_a Q with Q a rotation by 90 degrees in the first two axes.
    std::vector<float> xa(n * d), xb(n * d);
    for (size_t i = 0; i < n * d; i++) xa[i] = std::sin(0.7f * (float)(i * i % 97));
    for (size_t r = 0; r < n; r++) {
      xb[r * d + 0] = -xa[r * d + 1];
      xb[r * d + 1] = xa[r * d + 0];
      xb[r * d + 2] = xa[r * d + 2];
    }
    auto xc = bico::make<bico::xcov_ptr>(ctx.get(), bico_xcov_create, d, d, 0u);
    bico::check(bico_xcov_add(xc.get(), n, xa.data(), d, xb.data(), d), ctx.get());
    auto pr = bico::make<bico::procrustes_ptr>(ctx.get(), bico_procrustes_create);
    std::vector<float> r(d * d);
    size_t rank = 0;
    bico::check(bico_procrustes_solve(pr.get(), xc.get(), r.data(), d, &rank), ctx.get());
    // R maps x_a's coordinates to x_b's: row 0 is (0, 1, 0), row 1 (-1, 0, 0)
    double err = std::fabs(r[1] - 1) + std::fabs(r[3] + 1) + std::fabs(r[8] - 1);
    std::printf("rank %zu, R = [%g %g %g; %g %g %g; %g %g %g]\n", rank, r[0], r[1],
                r[2], r[3], r[4], r[5], r[6], r[7], r[8]);

    // A failure as a value: a zero-width accumulator is refused.
    auto bad = bico::try_make<bico::xcov_ptr>(ctx.get(), bico_xcov_create,
                                              size_t{0}, d, 0u);
    std::printf("try_make: %s\n", bad ? "made" : bad.message().c_str());
    bool ok = err < 1e-5 && rank == d && !bad && bad.status() == BICO_E_SHAPE;

    // A failure as an exception: a transfer whose source base is missing.
    auto t = bico::make<bico::transfer_ptr>(ctx.get(), bico_transfer_create);
    bico::check(bico_transfer_set_file(t.get(), BICO_FILE_SOURCE_BASE,
                                       "/nonexistent/A.safetensors"), ctx.get());
    try {
      bico::check(bico_transfer_check(t.get(), BICO_TRANSFER_CHECK_INPUTS), ctx.get());
      ok = false;
    } catch (const bico::error &e) {
      std::printf("caught: %s\n", e.what());
      ok = ok && e.status() == BICO_E_ARG;  // the target base is missing too
    }
    std::printf("cpp_wrapper: %s\n", ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
  } catch (const bico::error &e) {
    std::fprintf(stderr, "cpp_wrapper: %s\n", e.what());
    return 1;
  }
}
