"""End-to-end tests of the `bico` command on planted models.

The models, their calibration files and the expected answers are built here
with PyTorch (test/e2e/planted.py); the command under test only sees
safetensors files.  Run by `make check` (BICO_BUILD names the build tree).
"""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402

from cli import BICO, bico  # noqa: E402

torch.set_default_dtype(torch.float64)

# p > d: the patch embedding's outputs (plus positions) span the whole
# residual stream, so the first block's input statistics have full rank.
CFG = dict(p=32, n=6, d=24, heads=3, hidden=48, depth=2, classes=5)


def writes_residual(name):
    """Tensors whose (first, or for tokens last) axis is the residual stream
    as seen through an output-gradient map.  Every read of a pre-norm
    transformer's residual stream goes through a LayerNorm, which subtracts
    the mean: so every gradient with respect to the stream is orthogonal to
    the all-ones vector, the output statistics of the modules writing it have
    rank d - 1, and the component of an update along all-ones is both
    unidentifiable and irrelevant to the function.  Exactness holds modulo
    that direction."""
    return name in ("cls_token", "pos_embed") or name.startswith("patch_embed.") \
        or name.endswith("attn.proj.weight") or name.endswith("attn.proj.bias") \
        or name.endswith("mlp.fc2.weight") or name.endswith("mlp.fc2.bias")


def drop_ones(name, t):
    t = np.asarray(t, np.float64)
    if not writes_residual(name):
        return t
    if name in ("cls_token", "pos_embed"):
        return t - t.mean(axis=-1, keepdims=True)
    return t - t.mean(axis=0, keepdims=True)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def f32(sd):
    """Round a state dict to float32 (what the files hold), back in f64."""
    return {k: v.detach().to(torch.float32).to(torch.float64) for k, v in sd.items()}


# ------------------------------------------------------------------ ViT

@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    d = tmp_path_factory.mktemp("vit")
    gen = torch.Generator().manual_seed(7)
    A = pl.ViT(**{k: CFG[k] for k in ("p", "n", "d", "heads", "hidden", "depth", "classes")})
    pl.randomize(A, gen)
    sdA = f32(A.state_dict())
    tau = {k: (0.2 if v.dim() < 2 else 0.2 / math.sqrt(v.shape[-1]))
           * torch.randn(v.shape, generator=gen) for k, v in sdA.items()}
    tau = f32(tau)
    sdAft = {k: sdA[k] + tau[k] for k in sdA}
    sym = pl.vit_symmetry(CFG, gen)
    sdB = f32(pl.vit_transform(sdA, sym, CFG["depth"]))

    def model(sd):
        m = pl.ViT(**{k: CFG[k] for k in ("p", "n", "d", "heads", "hidden", "depth", "classes")})
        m.load_state_dict(sd)
        return m

    mA, mB, mAft = model(sdA), model(sdB), model(sdAft)
    S = 160
    x = torch.randn(S, CFG["n"], CFG["p"], generator=gen)
    z = torch.randn(S, CFG["classes"], generator=gen)
    # The fixture's own sanity: B computes A's function.
    with torch.no_grad():
        assert rel(mB(x), mA(x)) < 1e-5
    loss = lambda y: (y * z).sum()  # generic output gradients: full rank
    calA = pl.calibrate(mA, x, loss)
    calB = pl.calibrate(mB, x, loss)
    files = {k: str(d / f"{k}.safetensors") for k in
             ("A", "Aft", "B", "calA", "calB", "tau")}
    pl.save(files["A"], pl.to_numpy(sdA))
    pl.save(files["Aft"], pl.to_numpy(sdAft))
    pl.save(files["tau"], pl.to_numpy(tau))
    pl.save(files["B"], pl.to_numpy(sdB))
    pl.save(files["calA"], calA)
    pl.save(files["calB"], calB)
    xt = torch.randn(64, CFG["n"], CFG["p"], generator=gen)
    return dict(dir=d, files=files, sdA=sdA, sdB=sdB, sdAft=sdAft, tau=tau,
                sym=sym, model=model, x=xt, calA=calA, calB=calB, mAft=mAft)


def check_vit_exact(vit, out_path, tol_w=1e-4, tol_f=1e-4):
    out, _, order = pl.load(out_path)
    sdB = vit["sdB"]
    assert order == list(sdB.keys())  # every tensor of the target, in order
    expect = pl.vit_transform(vit["sdAft"], vit["sym"], CFG["depth"])
    for k in sdB:
        assert out[k].dtype == np.float32 and out[k].shape == tuple(sdB[k].shape)
        upd, want = out[k] - sdB[k].numpy(), (expect[k] - sdB[k]).numpy()
        assert rel(drop_ones(k, upd), drop_ones(k, want)) < tol_w, \
            (k, rel(drop_ones(k, upd), drop_ones(k, want)))
    m = vit["model"]({k: torch.from_numpy(v.astype(np.float64)) for k, v in out.items()})
    with torch.no_grad():
        got, want = m(vit["x"]), vit["mAft"](vit["x"])
        base = vit["model"](vit["sdB"])(vit["x"])
    change = rel(want, base)
    assert change > 0.05  # the task vector matters
    assert rel(got, want) < tol_f, (rel(got, want), change)
    return out


@pytest.mark.parametrize("split", ["3", "9"])
def test_vit_bico_recovers_planted_symmetry(vit, split):
    """B is A in other coordinates: BiCo returns the transformed task vector
    and B + tau_hat computes A_ft's function.  The qkv output is split in
    q, k, v (3) or per head (9 = 3 x 3 heads): both exact."""
    f = vit["files"]
    out = vit["dir"] / f"out{split}.safetensors"
    rep = vit["dir"] / f"rep{split}.json"
    r = bico("transfer", "--method", "bico", "--source-base", f["A"],
             "--source-tuned", f["Aft"], "--target-base", f["B"],
             "--source-calib", f["calA"], "--target-calib", f["calB"],
             "--split", f"attn.qkv={split}", "--report", rep, "--output", out)
    assert "updated" in r.stderr
    check_vit_exact(vit, out)
    report = json.load(open(rep))
    by = {e["name"]: e for e in report["tensors"]}
    assert len(by) == len(vit["sdB"])
    assert by["blocks.0.mlp.fc1.weight"]["handling"] == "linear"
    # The residual writers' output maps have rank d - 1 (see writes_residual).
    assert by["blocks.0.attn.proj.weight"]["maps"]["out"]["rank"] == CFG["d"] - 1
    assert by["patch_embed.proj.bias"]["maps"]["out"]["rank"] == CFG["d"] - 1
    assert by["blocks.0.mlp.fc1.weight"]["maps"]["in"]["rank"] == CFG["d"]
    assert by["blocks.0.mlp.fc1.weight"]["maps"]["out"]["rank"] == CFG["hidden"]
    assert len(by["blocks.1.attn.qkv.weight"]["maps"]["out_blocks"]) == int(split)
    assert by["blocks.1.norm1.bias"]["handling"] == "vector"
    assert by["cls_token"]["handling"] == "tied"
    assert by["pos_embed"]["handling"] == "tied"
    assert by["head.bias"]["handling"] == "vector"
    assert by["cls_token"]["source"] == "cls_token"
    assert by["head.weight"]["update_norm"] > 0


def test_vit_task_vector_input_and_stats_file(vit):
    """--task-vector instead of --source-tuned, and --stats (from `bico
    stats`, also merged from two halves of the calibration set) instead of
    calibration files: the same exact answer."""
    f, d = vit["files"], vit["dir"]
    stats = d / "stats.safetensors"
    bico("stats", "--source-calib", f["calA"], "--target-calib", f["calB"],
         "--output", stats)
    st, _, _ = pl.load(stats)
    c = st["blocks.0.mlp.fc1.in_xcov"]
    xa, xb = vit["calA"]["blocks.0.mlp.fc1.input"], vit["calB"]["blocks.0.mlp.fc1.input"]
    assert c.dtype == np.float64
    assert rel(c, xa.astype(np.float64).T @ xb.astype(np.float64)) < 1e-9
    # Halves of the rows, merged, equal the whole.
    halves = []
    for h, sl in enumerate((slice(0, 500), slice(500, None))):
        pa = d / f"calA{h}.safetensors"
        pb = d / f"calB{h}.safetensors"
        pl.save(pa, {k: v[sl] for k, v in vit["calA"].items()})
        pl.save(pb, {k: v[sl] for k, v in vit["calB"].items()})
        sh = d / f"stats{h}.safetensors"
        # (The final norm and head see 160 rows: their second half is empty.)
        bico("stats", "--source-calib", pa, "--target-calib", pb, "-o", sh)
        halves.append(sh)
    merged = d / "merged.safetensors"
    bico("stats", "--merge", *halves, "--output", merged)
    mg, _, _ = pl.load(merged)
    for k in st:
        assert rel(mg[k], st[k]) < 1e-6, k
    for src in (stats, merged):
        out = d / "out_stats.safetensors"
        bico("transfer", "--method", "bico", "--source-base", f["A"],
             "--task-vector", f["tau"], "--target-base", f["B"], "--stats", src,
             "--split", "attn.qkv=3", "--output", out, "--quiet")
        check_vit_exact(vit, out)


def test_vit_naive_is_not_exact_and_delta_output(vit):
    """Naive transfer across the symmetry is far off (the test above can
    fail), and --delta-output holds alpha * tau_hat alone."""
    f, d = vit["files"], vit["dir"]
    out, delta = d / "naive.safetensors", d / "delta.safetensors"
    bico("transfer", "--method", "naive", "--source-base", f["A"],
         "--source-tuned", f["Aft"], "--target-base", f["B"], "--alpha", "2.5",
         "--delta-output", delta, "--output", out)
    o, _, _ = pl.load(out)
    dl, _, _ = pl.load(delta)
    for k, v in vit["sdB"].items():
        want = v + 2.5 * vit["tau"][k]
        assert rel(o[k], want.numpy()) < 1e-6
        assert rel(dl[k], 2.5 * vit["tau"][k].numpy()) < 1e-6
    m = vit["model"]({k: torch.from_numpy(v.astype(np.float64)) for k, v in o.items()})
    with torch.no_grad():
        assert rel(m(vit["x"]), vit["mAft"](vit["x"])) > 1e-2


def test_vit_alpha_scales_the_update(vit):
    f, d = vit["files"], vit["dir"]
    out = d / "alpha.safetensors"
    bico("transfer", "--method", "bico", "--source-base", f["A"],
         "--source-tuned", f["Aft"], "--target-base", f["B"],
         "--source-calib", f["calA"], "--target-calib", f["calB"],
         "--split", "attn.qkv=3", "--alpha", "3", "--output", out, "-q")
    o, _, _ = pl.load(out)
    expect = pl.vit_transform(vit["tau"], vit["sym"], CFG["depth"])
    for k, v in vit["sdB"].items():
        assert rel(drop_ones(k, o[k] - v.numpy()),
                   drop_ones(k, 3 * expect[k].numpy())) < 1e-4, k


# ------------------------------------------------------------------ MLP

@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlp")
    gen = torch.Generator().manual_seed(11)
    A, B, maps = pl.mlp_widened(gen)
    A, B = f32(A), f32(B)
    tau = f32({k: 0.3 * torch.randn(v.shape, generator=gen) / math.sqrt(v.shape[-1])
               for k, v in A.items()})
    n = 400
    x = torch.randn(n, maps["E"].shape[1], generator=gen)
    gy = torch.randn(n, maps["F"].shape[1], generator=gen)
    calA = pl.mlp_calib(A, x, gy)
    # B sees the embedded inputs; its downstream reads F^T y, so its output
    # gradients are F gy.
    calB = pl.mlp_calib(B, x @ maps["E"].T, gy @ maps["F"].T)
    files = {k: str(d / f"{k}.safetensors") for k in ("A", "Aft", "B", "calA", "calB")}
    pl.save(files["A"], pl.to_numpy(A))
    pl.save(files["Aft"], pl.to_numpy({k: A[k] + tau[k] for k in A}))
    pl.save(files["B"], pl.to_numpy(B))
    pl.save(files["calA"], calA)
    pl.save(files["calB"], calB)
    return dict(dir=d, files=files, A=A, B=B, tau=tau, maps=maps, gen=gen)


def test_mlp_widened_exact_on_source_subspace(mlp):
    f, d, M = mlp["files"], mlp["dir"], mlp["maps"]
    out = d / "out.safetensors"
    bico("transfer", "--method", "bico", "--source-base", f["A"],
         "--source-tuned", f["Aft"], "--target-base", f["B"],
         "--source-calib", f["calA"], "--target-calib", f["calB"],
         "--output", out, "-q")
    o, _, _ = pl.load(out)
    E, F, Pi, tau, B = M["E"], M["F"], M["Pi"], mlp["tau"], mlp["B"]
    want = {
        "mlp.fc1.weight": Pi @ tau["mlp.fc1.weight"] @ E.T,
        "mlp.fc1.bias": Pi @ tau["mlp.fc1.bias"],
        "mlp.fc2.weight": F @ tau["mlp.fc2.weight"] @ Pi.T,
        "mlp.fc2.bias": F @ tau["mlp.fc2.bias"],
    }
    for k in want:
        assert rel(o[k] - B[k].numpy(), want[k].numpy()) < 1e-3, k
    # B_ft on A's subspace computes F A_ft.
    Bft = {k: torch.from_numpy(v.astype(np.float64)) for k, v in o.items()}
    Aft = {k: mlp["A"][k] + tau[k] for k in tau}
    x = torch.randn(50, E.shape[1], generator=mlp["gen"])
    yb, _ = pl.mlp_forward(Bft, x @ E.T)
    ya, _ = pl.mlp_forward(Aft, x)
    assert rel(yb, ya @ F.T) < 1e-4


def test_dead_layer_is_left_unchanged_and_reported(mlp, tmp_path):
    """A module whose calibration gradients are all zero (no loss reached
    it) has an all-zero output statistic: its tensors are left unchanged,
    the report says why, and nothing in the output is NaN; the other module
    is still transferred."""
    f = mlp["files"]
    calA, _, _ = pl.load(f["calA"])
    calB, _, _ = pl.load(f["calB"])
    for cal in (calA, calB):
        cal["mlp.fc2.output_grad"] = np.zeros_like(cal["mlp.fc2.output_grad"])
    pa, pb = str(tmp_path / "deadA.safetensors"), str(tmp_path / "deadB.safetensors")
    pl.save(pa, calA)
    pl.save(pb, calB)
    out, rep = tmp_path / "out.safetensors", tmp_path / "r.json"
    bico("transfer", "--method", "bico", "--source-base", f["A"],
         "--source-tuned", f["Aft"], "--target-base", f["B"],
         "--source-calib", pa, "--target-calib", pb,
         "--report", rep, "--output", out, "-q")
    o, _, _ = pl.load(out)
    B = mlp["B"]
    for k in o:
        assert np.all(np.isfinite(o[k])), k
    for k in ("mlp.fc2.weight", "mlp.fc2.bias"):
        assert np.array_equal(o[k], B[k].numpy().astype(np.float32)), k
    assert not np.array_equal(o["mlp.fc1.weight"],
                              B["mlp.fc1.weight"].numpy().astype(np.float32))
    r = json.load(open(rep))
    ents = r["tensors"] if isinstance(r, dict) else r
    byname = {e["name"]: e for e in ents}
    for k in ("mlp.fc2.weight", "mlp.fc2.bias"):
        assert byname[k]["handling"] == "unchanged", byname[k]
        assert "dead layer" in json.dumps(byname[k]), byname[k]
    assert byname["mlp.fc1.weight"]["handling"] == "linear"


def test_naive_refuses_different_shapes_and_keeps_output(mlp):
    f, d = mlp["files"], mlp["dir"]
    out = d / "existing.safetensors"
    out.write_bytes(b"precious bytes")
    r = bico("transfer", "--method", "naive", "--source-base", f["A"],
             "--source-tuned", f["Aft"], "--target-base", f["B"],
             "--output", out, ok=False)
    assert r.returncode == 1
    assert "mlp.fc1.weight" in r.stderr and "[32, 16]" in r.stderr \
        and "[24, 12]" in r.stderr, r.stderr
    assert out.read_bytes() == b"precious bytes"
    assert not [p for p in os.listdir(d) if "bico-tmp" in p]


def test_pad_pads_and_truncates(mlp):
    f, d = mlp["files"], mlp["dir"]
    out = d / "pad.safetensors"
    bico("transfer", "--method", "pad", "--source-base", f["A"],
         "--source-tuned", f["Aft"], "--target-base", f["B"], "--output", out, "-q")
    o, _, _ = pl.load(out)
    for k, t in mlp["tau"].items():
        want = np.zeros(tuple(mlp["B"][k].shape))
        sl = tuple(slice(0, min(a, b)) for a, b in zip(t.shape, want.shape))
        want[sl] = t.numpy()[sl]
        assert rel(o[k] - mlp["B"][k].numpy(), want) < 1e-6, k


# ------------------------------------------------------------------ depth

def test_pad_pairs_four_source_blocks_with_six_target_blocks(tmp_path):
    """Distinct per-block task vectors show which source block each target
    block took: 0, 1, 1, 2, 2, 3 (round(j * 3 / 5))."""
    A = {f"blocks.{i}.fc.weight": np.zeros((3, 3), np.float32) for i in range(4)}
    Aft = {f"blocks.{i}.fc.weight": np.full((3, 3), i + 1, np.float32) for i in range(4)}
    B = {f"blocks.{j}.fc.weight": np.zeros((4, 4), np.float32) for j in range(6)}
    for name, sd in (("A", A), ("Aft", Aft), ("B", B)):
        pl.save(tmp_path / f"{name}.safetensors", sd)
    out = tmp_path / "o.safetensors"
    bico("transfer", "--method", "pad", "--source-base", tmp_path / "A.safetensors",
         "--source-tuned", tmp_path / "Aft.safetensors",
         "--target-base", tmp_path / "B.safetensors", "--output", out, "-q")
    o, _, _ = pl.load(out)
    for j, i in enumerate([0, 1, 1, 2, 2, 3]):
        w = o[f"blocks.{j}.fc.weight"]
        assert np.all(w[:3, :3] == i + 1) and np.all(w[3:] == 0) and np.all(w[:, 3:] == 0)


# ------------------------------------------------------------------ gradfix

def test_gradfix_masks_by_votes(tmp_path):
    rng = np.random.default_rng(3)
    A = {"a.weight": rng.standard_normal((5, 4)).astype(np.float32),
         "a.bias": rng.standard_normal(5).astype(np.float32),
         "steps": np.array([3], np.int64)}
    tau = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in A.items()
           if k != "steps"}
    Aft = dict(A, **{k: A[k] + tau[k] for k in tau})
    B = {k: (v + 1).astype(v.dtype) for k, v in A.items()}
    votes = {k: rng.integers(-4, 5, tau[k].shape).astype(np.int32) for k in tau}
    for name, sd in (("A", A), ("Aft", Aft), ("B", B), ("V", votes)):
        pl.save(tmp_path / f"{name}.safetensors", sd)
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    bico("transfer", "--method", "gradfix", "--source-base", tmp_path / "A.safetensors",
         "--source-tuned", tmp_path / "Aft.safetensors",
         "--target-base", tmp_path / "B.safetensors",
         "--target-votes", tmp_path / "V.safetensors", "--alpha", "0.5",
         "--report", rep, "--output", out, "-q")
    o, _, _ = pl.load(out)
    report = {e["name"]: e for e in json.load(open(rep))["tensors"]}
    for k, t in tau.items():
        mask = (np.sign(t) == np.sign(votes[k])) & (votes[k] != 0)
        d_ = o[k].astype(np.float64) - B[k].astype(np.float64)
        assert np.allclose(d_, 0.5 * mask * t, atol=1e-6), k
        assert report[k]["handling"] == "masked"
        assert abs(report[k]["kept_fraction"] - mask.mean()) < 1e-12
    assert o["steps"].dtype == np.int64 and o["steps"][0] == 4
    assert report["steps"]["handling"] == "unchanged"


# ------------------------------------------------------------------ errors

def test_usage_errors_exit_2(vit):
    f = vit["files"]
    base = ["transfer", "--source-base", f["A"], "--source-tuned", f["Aft"],
            "--target-base", f["B"], "--output", vit["dir"] / "u.safetensors"]
    r = bico(*base, "--method", "magic", ok=False)
    assert r.returncode == 2 and "magic" in r.stderr
    r = bico(*base[:-2], "--method", "naive", ok=False)
    assert r.returncode == 2 and "--output" in r.stderr
    r = bico(*base, "--method", "bico", ok=False)  # no calibration
    assert r.returncode == 2 and "--stats" in r.stderr
    r = bico(*base, "--method", "naive", "--alpha", "-1", ok=False)
    assert r.returncode == 2 and "--alpha" in r.stderr
    r = bico(*base, "--method", "naive", "--frobnicate", ok=False)
    assert r.returncode == 2 and "--frobnicate" in r.stderr
    r = bico(*base, "--method", "bico", "--source-calib", f["calA"], ok=False)
    assert r.returncode == 2 and "target-calib" in r.stderr
    r = bico("frobnicate", ok=False)
    assert r.returncode == 2
    assert not os.path.exists(vit["dir"] / "u.safetensors")


def test_data_errors_name_the_culprit(vit, tmp_path):
    f = vit["files"]
    common = ["transfer", "--method", "bico", "--source-base", f["A"],
              "--source-tuned", f["Aft"], "--target-base", f["B"]]
    out = tmp_path / "o.safetensors"
    # A module missing from the target calibration.
    cal = dict(vit["calB"])
    del cal["blocks.1.mlp.fc2.input"]
    pl.save(tmp_path / "calB_missing.safetensors", cal)
    r = bico(*common, "--source-calib", f["calA"], "--target-calib",
             tmp_path / "calB_missing.safetensors", "--output", out, ok=False)
    assert r.returncode == 1 and "blocks.1.mlp.fc2.input" in r.stderr, r.stderr
    # Mismatched rows.
    cal = dict(vit["calB"])
    cal["blocks.0.attn.proj.input"] = cal["blocks.0.attn.proj.input"][:-7]
    pl.save(tmp_path / "calB_rows.safetensors", cal)
    r = bico(*common, "--source-calib", f["calA"], "--target-calib",
             tmp_path / "calB_rows.safetensors", "--output", out, ok=False)
    assert r.returncode == 1 and "blocks.0.attn.proj" in r.stderr \
        and "rows" in r.stderr, r.stderr
    # Output equal to an input (also through another path to it).
    r = bico(*common, "--source-calib", f["calA"], "--target-calib", f["calB"],
             "--output", f["B"], ok=False)
    assert r.returncode == 1 and "input" in r.stderr
    link = tmp_path / "link.safetensors"
    os.symlink(f["B"], link)
    before = open(f["B"], "rb").read()
    r = bico(*common, "--source-calib", f["calA"], "--target-calib", f["calB"],
             "--output", link, ok=False)
    assert r.returncode == 1 and open(f["B"], "rb").read() == before
    # A --split that matches nothing is named.
    r = bico(*common, "--source-calib", f["calA"], "--target-calib", f["calB"],
             "--split", "attn.qvk=3", "--output", out, ok=False)
    assert r.returncode == 1 and "attn.qvk" in r.stderr, r.stderr
    # A malformed file is named.
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{oops}  ")
    r = bico(*common, "--source-calib", bad, "--target-calib", f["calB"],
             "--output", out, ok=False)
    assert r.returncode == 1 and "bad.safetensors" in r.stderr
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if "bico-tmp" in p]


def test_failed_write_leaves_existing_output(vit, tmp_path):
    """A full disk is simulated with a file-size limit: the write fails with
    an error (SIGXFSZ is ignored), the old output stays byte-identical."""
    import resource
    f = vit["files"]
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"old")

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    r = subprocess.run([BICO, "transfer", "--method", "naive", "--source-base", f["A"],
                        "--source-tuned", f["Aft"], "--target-base", f["B"],
                        "--output", str(out)], capture_output=True, text=True,
                       preexec_fn=limit)
    assert r.returncode == 1, r.stderr
    assert out.read_bytes() == b"old"
    assert not [p for p in os.listdir(tmp_path) if "bico-tmp" in p]


def test_inspect_lists_modules_and_blocks(vit):
    r = bico("inspect", vit["files"]["B"])
    assert "blocks: blocks.<i> (2 blocks)" in r.stdout
    assert "blocks.1.attn.qkv" in r.stdout and "linear" in r.stdout
    assert "cls_token" in r.stdout and "token" in r.stdout
    assert "F32" in r.stdout and "[72, 24]" in r.stdout
    r = bico("inspect", vit["dir"] / "nonexistent.safetensors", ok=False)
    assert r.returncode == 1 and "nonexistent" in r.stderr


def test_docs_calibration_snippet_matches(vit, tmp_path):
    """The PyTorch recipe in docs/formats.md, run as written (with a stand-in
    for bico.safetensors.write, so that this file does not load the library
    into the interpreter: under SANITIZE=1 it runs without the ASan
    runtime), gives the calibration file the tests use, also when the
    samples come in two batches."""
    import re
    import types
    text = open(os.path.join(HERE, "..", "..", "docs", "formats.md")).read()
    sec = text[text.index("### Producing a calibration file"):]
    code = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    fake = types.ModuleType("bico.safetensors")
    fake.write = lambda path, d: pl.save(
        path, {k: v.detach().contiguous().numpy() for k, v in d.items()})
    pkg = types.ModuleType("bico")
    pkg.safetensors = fake
    saved = {k: sys.modules.get(k) for k in ("bico", "bico.safetensors")}
    sys.modules.update({"bico": pkg, "bico.safetensors": fake})
    try:
        ns = {}
        exec(code, ns)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    gen = torch.Generator().manual_seed(7)
    m = vit["model"](vit["sdA"])
    x = torch.randn(40, CFG["n"], CFG["p"], generator=gen)
    z = torch.randn(40, CFG["classes"], generator=gen)
    path = tmp_path / "doc.safetensors"
    ns["calibration_file"](m, [(x[:25], z[:25]), (x[25:], z[25:])],
                           lambda out, y: (out * y).sum(), str(path))
    got, _, _ = pl.load(path)
    want = pl.calibrate(m, x, lambda out: (out * z).sum())
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape and rel(got[k], want[k]) < 1e-6, k


@pytest.mark.parametrize("opts", [
    ["--method", "bico-in"], ["--method", "bico-out"],
    ["--method", "bico", "--norm-map", "grad"],
    ["--method", "bico", "--null", "drop", "--rank-tol", "1e-3"],
    ["--method", "bico", "--center", "--whiten", "0.25", "--threads", "2"],
])
def test_vit_options(vit, tmp_path, opts):
    """Each option runs and the report shows what it did; the ranks are
    predicted from the model, not read off the code."""
    f = vit["files"]
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    bico("transfer", *opts, "--source-base", f["A"], "--source-tuned", f["Aft"],
         "--target-base", f["B"], "--source-calib", f["calA"],
         "--target-calib", f["calB"], "--split", "attn.qkv=3",
         "--report", rep, "--output", out, "-q")
    o, _, _ = pl.load(out)
    assert all(np.all(np.isfinite(v)) for v in o.values())
    by = {e["name"]: e for e in json.load(open(rep))["tensors"]}
    maps = by["blocks.0.mlp.fc1.weight"]["maps"]
    if opts[1] == "bico-in":
        assert set(maps) == {"in"}
        # bico-in: the output side is the identity, so the bias is unchanged
        # in value (tau itself), i.e. the update equals tau_b.
        assert rel(o["blocks.0.mlp.fc1.bias"] - vit["sdB"]["blocks.0.mlp.fc1.bias"].numpy(),
                   vit["tau"]["blocks.0.mlp.fc1.bias"].numpy()) < 1e-6
    elif opts[1] == "bico-out":
        assert set(maps) == {"out"}
    else:
        assert set(maps) == {"in", "out"}
    if "grad" in opts:
        # The final norm's output gradients are head.weight^T z: rank =
        # number of classes.
        assert by["norm.weight"]["maps"]["out"]["rank"] == CFG["classes"]
    elif "--rank-tol" in opts:
        # A coarser tolerance counts fewer singular values.
        assert by["norm.weight"]["maps"]["in"]["rank"] < CFG["d"]
    else:
        assert by["norm.weight"]["maps"]["in"]["rank"] == CFG["d"]


def test_sharded_target_and_dtypes_are_kept(tmp_path):
    """A sharded target (index.json) reads as one model; the output keeps
    each tensor's dtype; tensors without a source partner and integer
    tensors are copied byte for byte."""
    rng = np.random.default_rng(5)
    A = {"a.weight": rng.standard_normal((4, 3)).astype(np.float32),
         "b.weight": rng.standard_normal((2, 4)).astype(np.float32)}
    tau = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in A.items()}
    Aft = {k: A[k] + tau[k] for k in A}
    B1 = {"a.weight": rng.standard_normal((4, 3)).astype(np.float16)}
    B2 = {"b.weight": rng.standard_normal((2, 4)).astype(np.float64),
          "extra.weight": rng.standard_normal((3, 3)).astype(np.float32),
          "count": np.array([7], np.int64)}
    pl.save(tmp_path / "A.safetensors", A)
    pl.save(tmp_path / "Aft.safetensors", Aft)
    pl.save(tmp_path / "B-1.safetensors", B1)
    pl.save(tmp_path / "B-2.safetensors", B2)
    index = {"metadata": {}, "weight_map": {**{k: "B-1.safetensors" for k in B1},
                                            **{k: "B-2.safetensors" for k in B2}}}
    (tmp_path / "B.safetensors.index.json").write_text(json.dumps(index))
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    bico("transfer", "--method", "naive", "--source-base", tmp_path / "A.safetensors",
         "--source-tuned", tmp_path / "Aft.safetensors",
         "--target-base", tmp_path / "B.safetensors.index.json",
         "--report", rep, "--output", out, "-q")
    o, _, order = pl.load(out)
    assert order == ["a.weight", "b.weight", "extra.weight", "count"]
    assert o["a.weight"].dtype == np.float16 and o["b.weight"].dtype == np.float64
    want_a = (B1["a.weight"].astype(np.float32) + tau["a.weight"]).astype(np.float16)
    assert np.array_equal(o["a.weight"], want_a)
    assert np.allclose(o["b.weight"], B2["b.weight"] + tau["b.weight"], rtol=1e-6, atol=1e-6)
    assert o["extra.weight"].tobytes() == B2["extra.weight"].tobytes()
    assert o["count"].tobytes() == B2["count"].tobytes()
    by = {e["name"]: e for e in json.load(open(rep))["tensors"]}
    assert by["extra.weight"]["handling"] == "unchanged" and by["extra.weight"]["source"] is None
    assert "reason" in by["extra.weight"]


def test_workers_and_proc_methods_give_the_same_answer(vit, tmp_path):
    """--threads/--workers: the maps are solved by W threads while the main
    thread writes; the output and report are byte-identical to one thread
    (on the planted ViT: splits, ties, norms, rank-deficient residual maps
    that fall back to the SVD).  --proc-method svd and polar reach the same
    planted answer.  Bad values are usage errors."""
    f = vit["files"]
    common = ["transfer", "--method", "bico", "--source-base", f["A"],
              "--source-tuned", f["Aft"], "--target-base", f["B"],
              "--source-calib", f["calA"], "--target-calib", f["calB"],
              "--split", "attn.qkv=3",
              "-q"]
    runs = {}
    for opts in (["--threads", "1"], ["--threads", "3"], ["--threads", "2", "--workers", "1"],
                 ["--threads", "4", "--workers", "2"],
                 ["--threads", "3", "--solve-memory", "1K"]):
        key = " ".join(opts)
        out, rep = tmp_path / f"o{len(runs)}.safetensors", tmp_path / f"r{len(runs)}.json"
        bico(*common, *opts, "--report", rep, "--output", out)
        runs[key] = (open(out, "rb").read(), open(rep, "rb").read())
    first = runs["--threads 1"]
    for key, got in runs.items():
        assert got == first, key
    for method in ("svd", "polar", "eig"):
        out = tmp_path / f"{method}.safetensors"
        bico(*common, "--proc-method", method, "--threads", "2", "--output", out)
        check_vit_exact(vit, out)
    for bad in (["--workers", "0"], ["--workers", "x"], ["--proc-method", "qr"],
                ["--solve-memory", "12Q"], ["--solve-memory", "-1"]):
        r = bico(*common, *bad, "--output", tmp_path / "bad.safetensors", ok=False)
        assert r.returncode == 2 and bad[0] in r.stderr, (bad, r.stderr)
        assert not os.path.exists(tmp_path / "bad.safetensors")


HOSTILE_NAMES = ["blocks.0.\x1b]0;pwned\x07.weight", "blocks.0.\x1b[31mred.weight",
                 "c\u009b2J.weight", "back\\slash.bias"]


def _raw_controls(text):
    """Control characters that reach a terminal raw (newline aside)."""
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) < 0xa0]


def test_inspect_escapes_control_characters(tmp_path):
    """issue 22: tensor names (and metadata) with terminal escape sequences
    were printed raw.  Text output escapes them; --json escapes them per
    JSON, so that the names read back are the file's names."""
    p = tmp_path / "evil.safetensors"
    pl.save(str(p), {n: np.ones((2, 3), np.float32) for n in HOSTILE_NAMES},
            metadata={"note\x1b[2J": "v\x1b]52;c;AAAA\x07"})
    r = bico("inspect", p, timeout=60)
    assert _raw_controls(r.stdout) == [], repr(r.stdout)
    assert "blocks.0.\\x1b]0;pwned\\x07.weight" in r.stdout, r.stdout
    assert "c\\u009b2J.weight" in r.stdout and "back\\\\slash.bias" in r.stdout, r.stdout
    r = bico("inspect", p, p, "--json", "--method", "naive", timeout=60)
    assert _raw_controls(r.stdout) == [], repr(r.stdout)
    got = {t["name"] for t in json.loads(r.stdout)["tensors"]}
    assert got == set(HOSTILE_NAMES)
    r = bico("inspect", p, p, "--method", "naive", timeout=60)
    assert _raw_controls(r.stdout) == [], repr(r.stdout)


def test_error_messages_escape_control_characters(tmp_path):
    """A name from a file inside an error message reaches stderr escaped."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    pl.save(str(a), {n: np.ones((2, 3), np.float32) for n in HOSTILE_NAMES})
    pl.save(str(b), {n: np.ones((3, 3), np.float32) for n in HOSTILE_NAMES})
    r = bico("transfer", "--method", "naive", "--source-base", a, "--source-tuned", a,
             "--target-base", b, "--output", tmp_path / "o.safetensors", ok=False,
             timeout=60)
    assert r.returncode == 1, r.stderr
    assert _raw_controls(r.stderr) == [], repr(r.stderr)
    assert "\\x1b" in r.stderr, r.stderr
