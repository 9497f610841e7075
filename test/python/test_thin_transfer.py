"""`bico transfer` picks the thin solve by itself when a module has no more
calibration rows than its widths (docs/methods.md, "Thin solves"), says so
in the report ("solve": "thin" / "full"), and gives the maps an
independent NumPy computation (SVD of the d_a x d_b statistic) gives, and
that a statistics file (the full solve) gives, with --null drop.
Run by `make check` (BICO_BUILD names the build tree)."""
import json
import os

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402

from cli import bico  # noqa: E402

# Source and target widths: fc1 [h, d], fc2 [c, h].
DA, HA, CA = 12, 24, 6
DB, HB, CB = 16, 32, 8
N = 12  # rows: == d_a for fc1's input map, < the hidden widths, > c


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def ref_map(xa, xb, tol=1e-5):
    """The DROP map U_k V_k^T of C = xa^T xb, in NumPy."""
    c = xa.astype(np.float64).T @ xb.astype(np.float64)
    u, s, vt = np.linalg.svd(c, full_matrices=False)
    k = int(np.sum(s > tol * s[0]))
    return u[:, :k] @ vt[:k], k


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("thin")
    g = np.random.default_rng(3)
    f32 = lambda *s: g.standard_normal(s).astype(np.float32)
    A = {"mlp.fc1.weight": f32(HA, DA), "mlp.fc1.bias": f32(HA),
         "mlp.fc2.weight": f32(CA, HA), "mlp.fc2.bias": f32(CA)}
    B = {"mlp.fc1.weight": f32(HB, DB), "mlp.fc1.bias": f32(HB),
         "mlp.fc2.weight": f32(CB, HB), "mlp.fc2.bias": f32(CB)}
    tau = {k: (0.1 * g.standard_normal(v.shape)).astype(np.float32)
           for k, v in A.items()}
    Aft = {k: (A[k] + tau[k]).astype(np.float32) for k in A}
    tau = {k: Aft[k].astype(np.float64) - A[k] for k in A}
    widths = {"mlp.fc1": ((DA, HA), (DB, HB)), "mlp.fc2": ((HA, CA), (HB, CB))}
    calA, calB = {}, {}
    for m, ((ia, oa), (ib, ob)) in widths.items():
        calA[m + ".input"], calB[m + ".input"] = f32(N, ia), f32(N, ib)
        calA[m + ".output_grad"], calB[m + ".output_grad"] = f32(N, oa), f32(N, ob)
    files = {k: str(d / f"{k}.safetensors")
             for k in ("A", "Aft", "B", "calA", "calB", "stats")}
    for k, v in (("A", A), ("Aft", Aft), ("B", B), ("calA", calA),
                 ("calB", calB)):
        pl.save(files[k], v)
    bico("stats", "--source-calib", files["calA"], "--target-calib",
         files["calB"], "--output", files["stats"])
    return dict(dir=d, files=files, A=A, B=B, tau=tau, calA=calA, calB=calB)


def run(pair, name, *inputs, null="drop"):
    f = pair["files"]
    out, rep = pair["dir"] / f"{name}.safetensors", pair["dir"] / f"{name}.json"
    bico("transfer", "--method", "bico", "--source-base", f["A"],
         "--source-tuned", f["Aft"], "--target-base", f["B"], *inputs,
         "--null", null, "--report", rep, "--output", out)
    with open(rep) as fh:
        report = json.load(fh)
    return pl.load(str(out))[0], {t["name"]: t for t in report["tensors"]}


def test_driver_picks_thin_and_matches_numpy(pair):
    f = pair["files"]
    out, by = run(pair, "thin", "--source-calib", f["calA"], "--target-calib",
                  f["calB"])
    maps = by["mlp.fc1.weight"]["maps"]
    assert maps["in"]["solve"] == "thin"   # N == d_a = 12: the edge, thin
    assert maps["out"]["solve"] == "thin"  # N < 24
    assert by["mlp.fc2.weight"]["maps"]["in"]["solve"] == "thin"
    assert by["mlp.fc2.weight"]["maps"]["out"]["solve"] == "full"  # N > c = 6
    cA, cB, tau, B = pair["calA"], pair["calB"], pair["tau"], pair["B"]
    for m in ("mlp.fc1", "mlp.fc2"):
        r_in, k_in = ref_map(cA[m + ".input"], cB[m + ".input"])
        r_out, k_out = ref_map(cA[m + ".output_grad"], cB[m + ".output_grad"])
        assert by[m + ".weight"]["maps"]["in"]["rank"] == k_in
        assert by[m + ".weight"]["maps"]["out"]["rank"] == k_out
        want_w = r_out.T @ tau[m + ".weight"] @ r_in
        want_b = r_out.T @ tau[m + ".bias"]
        got_w = out[m + ".weight"].astype(np.float64) - B[m + ".weight"]
        got_b = out[m + ".bias"].astype(np.float64) - B[m + ".bias"]
        assert rel(got_w, want_w) < 1e-4, (m, rel(got_w, want_w))
        assert rel(got_b, want_b) < 1e-4, (m, rel(got_b, want_b))


def test_thin_equals_statistics_file(pair):
    """The same maps from a statistics file (the full d_a x d_b solve):
    --null drop makes both exactly the partial isometry."""
    f = pair["files"]
    thin, by_t = run(pair, "thin2", "--source-calib", f["calA"],
                     "--target-calib", f["calB"])
    full, by_f = run(pair, "full", "--stats", f["stats"])
    assert by_f["mlp.fc1.weight"]["maps"]["out"]["solve"] == "full"
    for k in thin:
        assert rel(thin[k] - pair["B"][k], full[k] - pair["B"][k]) < 1e-4, k
    for k in by_t:
        for side in by_t[k].get("maps", {}):
            assert by_t[k]["maps"][side]["rank"] == by_f[k]["maps"][side]["rank"]


def test_keep_thin_same_on_calibration_rows(pair):
    """With KEEP (the default) only the unidentified completion differs:
    on the calibration rows the carried update acts the same, i.e.
    (update) X_b^T agrees between the thin and the full runs."""
    f = pair["files"]
    thin, _ = run(pair, "keep_thin", "--source-calib", f["calA"],
                  "--target-calib", f["calB"], null="keep")
    full, _ = run(pair, "keep_full", "--stats", f["stats"], null="keep")
    xb = pair["calB"]["mlp.fc1.input"].astype(np.float64)
    gb = pair["calB"]["mlp.fc1.output_grad"].astype(np.float64)
    ut = thin["mlp.fc1.weight"].astype(np.float64) - pair["B"]["mlp.fc1.weight"]
    uf = full["mlp.fc1.weight"].astype(np.float64) - pair["B"]["mlp.fc1.weight"]
    assert rel(gb @ ut @ xb.T, gb @ uf @ xb.T) < 1e-4
    assert rel(ut, uf) > 1e-3  # the completions do differ off the rows
