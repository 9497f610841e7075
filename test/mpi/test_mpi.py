"""Tests of bico-mpi (the bico command under MPI) against the serial bico.

Run by `make check MPI=1` (BICO_BUILD names the build tree, BICO_MPI the
binary, MPIRUN the launcher).  Every MPI run is on this machine's loopback
with --oversubscribe; the reference is always the single-process command,
whose own correctness test/python/test_bico_cli.py establishes.  Models and
calibration data are random (test/e2e/planted.py writes the files)."""
import glob
import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import planted as pl  # noqa: E402

BUILD = os.environ.get("BICO_BUILD", os.path.join(HERE, "..", "..", "build"))
BICO = os.path.join(BUILD, "bin", "bico")
BICO_MPI = os.environ.get("BICO_MPI", os.path.join(BUILD, "bin", "bico-mpi"))
MPIRUN = os.environ.get("MPIRUN", "mpirun")

torch.set_default_dtype(torch.float64)


def serial(*args, ok=True):
    r = subprocess.run([BICO, *map(str, args)], capture_output=True, text=True)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def mpi(n, *args, env=None, ok=True):
    e = dict(os.environ)
    # CI runs as root; shared-memory transport without ptrace (containers).
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_btl_vader_single_copy_mechanism="none",
             OMPI_MCA_rmaps_base_oversubscribe="1")
    e.update(env or {})
    r = subprocess.run([MPIRUN, "--oversubscribe", "-np", str(n), BICO_MPI,
                        *map(str, args)], capture_output=True, text=True,
                       env=e, timeout=60)
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    nb = np.linalg.norm(b)
    return np.linalg.norm(a - b) / nb if nb > 0 else np.linalg.norm(a - b)


def same_tensors(p, q, tol=1e-6):
    a, ma, oa = pl.load(p)
    b, mb, ob = pl.load(q)
    assert oa == ob and ma == mb
    for k in oa:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert rel(a[k], b[k]) <= tol, (k, rel(a[k], b[k]))
    return a


def no_leftovers(d):
    return [f for f in os.listdir(d) if ".bico-tmp." in f]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Source ViT (width 24, 2 blocks) and a wider, deeper random target
    (width 32, 3 blocks): rectangular maps and a depth map."""
    d = tmp_path_factory.mktemp("mpi")
    gen = torch.Generator().manual_seed(11)
    A = pl.ViT(p=16, n=5, d=24, heads=3, hidden=48, depth=2, classes=5)
    B = pl.ViT(p=16, n=5, d=32, heads=4, hidden=64, depth=3, classes=5)
    pl.randomize(A, gen)
    pl.randomize(B, gen)
    sdA = {k: v.detach() for k, v in A.state_dict().items()}
    tau = {k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in sdA.items()}
    x = torch.randn(120, 5, 16, generator=gen)
    z = torch.randn(120, 5, generator=gen)
    loss = lambda y: (y * z).sum()
    calA, calB = pl.calibrate(A, x, loss), pl.calibrate(B, x, loss)
    f = {k: str(d / f"{k}.safetensors") for k in ("A", "tau", "B", "calA", "calB")}
    pl.save(f["A"], pl.to_numpy(sdA))
    pl.save(f["tau"], pl.to_numpy(tau))
    pl.save(f["B"], pl.to_numpy({k: v.detach() for k, v in B.state_dict().items()}))
    pl.save(f["calA"], calA)
    pl.save(f["calB"], calB)
    # The same calibration rows in three shards (unequal sizes).
    cuts = [0, 170, 420, len(next(iter(calA.values())))]
    for i in range(3):
        for side, cal in (("A", calA), ("B", calB)):
            part = {k: v[cuts[i]:cuts[i + 1]] for k, v in cal.items()}
            f[f"cal{side}{i}"] = str(d / f"cal{side}{i}.safetensors")
            pl.save(f[f"cal{side}{i}"], part)
    f["stats"] = str(d / "stats.safetensors")
    serial("stats", "--source-calib", f["calA"], "--target-calib", f["calB"],
           "--output", f["stats"])
    return dict(dir=d, f=f)


COMMON = lambda f: ["--source-base", f["A"], "--task-vector", f["tau"],
                    "--target-base", f["B"]]


@pytest.mark.parametrize("n", [2, 3])
def test_stats_equal_serial_with_tiny_reduction_chunks(models, n):
    f, d = models["f"], models["dir"]
    out = d / f"stats_np{n}.safetensors"
    # 7 doubles per MPI_Reduce: every statistic (>= 24 x 32) takes many.
    r = mpi(n, "stats", "--source-calib", f["calA"], "--target-calib", f["calB"],
            "--output", out, env={"BICO_MPI_CHUNK": "7"})
    assert f"{n} ranks" in r.stderr and "reduction" in r.stderr
    s = same_tensors(out, f["stats"])
    assert len(s) >= 20


def test_stats_several_files_per_rank(models):
    f, d = models["f"], models["dir"]
    out = d / "stats_shards.safetensors"
    args = []
    for i in range(3):
        args += ["--source-calib", f[f"calA{i}"], "--target-calib", f[f"calB{i}"]]
    mpi(2, "stats", *args, "--output", out)
    same_tensors(out, f["stats"])
    # --merge (rank 0 alone) of per-shard statistics gives the same sums.
    parts = []
    for i in range(2):
        parts.append(d / f"part{i}.st")
        serial("stats", "--source-calib", f[f"calA{i}"], "--target-calib",
               f[f"calB{i}"], "--output", parts[-1])
    merged, ref = d / "merged.st", d / "merged_ref.st"
    mpi(3, "stats", "--merge", *parts, "--output", merged)
    serial("stats", "--merge", *parts, "--output", ref)
    same_tensors(merged, ref, tol=0)


@pytest.mark.parametrize("n", [2, 3])
def test_transfer_equals_serial_with_report(models, n):
    f, d = models["f"], models["dir"]
    opts = ["--method", "bico", "--source-calib", f["calA"], "--target-calib",
            f["calB"], "--split", "attn.qkv=3", "--alpha", "0.7"]
    ref, refd, refr = d / "ser.st", d / "ser_delta.st", d / "ser.json"
    serial("transfer", *COMMON(f), *opts, "--output", ref, "--delta-output",
           refd, "--report", refr, "--quiet")
    out, outd, outr = d / f"mpi{n}.st", d / f"mpi{n}_delta.st", d / f"mpi{n}.json"
    # With 3 ranks, rank 0 only writes (what it does from 4 ranks on).
    env = {"BICO_MPI_CHUNK": "1000", "BICO_MPI_RANK0_SHARE": "0" if n == 3 else "0.5"}
    r = mpi(n, "transfer", *COMMON(f), *opts, "--output", out,
            "--delta-output", outd, "--report", outr, env=env)
    same_tensors(out, ref)
    same_tensors(outd, refd)
    # Same maps, same arithmetic: the checkpoint is even byte-identical.
    assert open(out, "rb").read() == open(ref, "rb").read()
    # The library assembles the report from the ranks' entries: the same
    # text as the single process's.
    assert open(outr, "rb").read() == open(refr, "rb").read()
    a = json.load(open(outr))
    assert a["summary"]["linear"] > 0
    # Which rank did what: one log line per rank.
    per = {}
    for line in r.stderr.splitlines():
        m = re.search(r"bico: rank (\d+) \((.+?)\): (\d+) tensors \((\d+) "
                      r"updated\).* ([0-9.]+) s \(CPU", line)
        if m:
            per[int(m.group(1))] = int(m.group(3))
            assert m.group(2) and float(m.group(5)) >= 0
    assert sorted(per) == list(range(n)), r.stderr
    assert sum(per.values()) == len(a["tensors"])
    assert sum(1 for v in per.values() if v > 0) >= 2  # the work was shared
    if n == 3:
        assert per[0] == 0
    for k in range(n):
        assert f"rank {k} (" in r.stderr
    assert not no_leftovers(d)


def test_transfer_stats_file_and_baselines(models):
    f, d = models["f"], models["dir"]
    for method, extra in (("bico-in", ["--stats", f["stats"]]),
                          ("pad", [])):
        ref, out = d / f"ser_{method}.st", d / f"mpi_{method}.st"
        serial("transfer", *COMMON(f), "--method", method, *extra, "--output",
               ref, "--quiet")
        mpi(3, "transfer", *COMMON(f), "--method", method, *extra, "--output",
            out, "--quiet")
        same_tensors(out, ref)


def test_failing_rank_leaves_no_output_and_names_itself(models):
    f, d = models["f"], models["dir"]
    out = d / "fail.st"
    out.write_bytes(b"old contents")
    r = mpi(3, "transfer", *COMMON(f), "--method", "bico", "--stats",
            f["stats"], "--output", out, "--report", d / "fail.json",
            env={"BICO_MPI_TEST_FAIL": "1:1"}, ok=False)
    assert r.returncode != 0
    assert "bico transfer: rank 1: injected failure at tensor" in r.stderr
    assert out.read_bytes() == b"old contents"
    assert not os.path.exists(d / "fail.json")
    assert not no_leftovers(d)


def test_data_error_is_reported_once_with_no_output(models):
    f, d = models["f"], models["dir"]
    out = d / "err.st"
    # The statistics file lacks the target's blocks.2 (it is the A x B one,
    # but with a different --blocks the pairing names are wrong): use a
    # statistics file of the wrong shape instead, the source's own.
    bad = d / "bad_stats.st"
    pl.save(bad, {"nothing": np.zeros((2, 2), np.float64)})
    r = mpi(2, "transfer", *COMMON(f), "--method", "bico", "--stats", bad,
            "--output", out, ok=False)
    assert r.returncode != 0
    assert "has no tensor" in r.stderr and str(bad) in r.stderr
    assert not os.path.exists(out)
    assert not no_leftovers(d)


def test_killed_rank_leaves_no_output(models):
    f, d = models["f"], models["dir"]
    out = d / "killed.st"
    r = mpi(3, "transfer", *COMMON(f), "--method", "bico", "--source-calib",
            f["calA"], "--target-calib", f["calB"], "--output", out,
            env={"BICO_MPI_TEST_KILL": "2:2"}, ok=False)
    assert r.returncode != 0
    both = r.stdout + r.stderr
    assert "signal 9" in both or "Killed" in both
    # mpirun stopped rank 0 (SIGTERM, or SIGPIPE when its output pipe
    # closed first), whose handler removed the temporary file.
    assert not os.path.exists(out)
    assert not no_leftovers(d), both


def test_stats_rank_failure_and_kill(models):
    f, d = models["f"], models["dir"]
    out = d / "stats_fail.st"
    args = ["stats", "--source-calib", f["calA"], "--target-calib", f["calB"],
            "--output", out]
    r = mpi(3, *args, env={"BICO_MPI_TEST_FAIL": "2:3"}, ok=False)
    assert r.returncode != 0
    assert "bico stats: rank 2: injected failure at statistic" in r.stderr
    assert not os.path.exists(out) and not no_leftovers(d)
    r = mpi(2, *args, env={"BICO_MPI_TEST_KILL": "1:2"}, ok=False)
    assert r.returncode != 0
    assert not os.path.exists(out) and not no_leftovers(d)


def test_stats_nan_in_one_ranks_rows_stops_every_rank(models):
    f, d = models["f"], models["dir"]
    cal, _, order = pl.load(f["calB"])
    key = order[3]
    cal[key][-1, 0] = np.nan  # the last row: rank 1's range of 2
    bad = d / "calB_nan.st"
    pl.save(bad, {k: cal[k] for k in order})
    out = d / "stats_nan.st"
    r = mpi(2, "stats", "--source-calib", f["calA"], "--target-calib", bad,
            "--output", out, ok=False)
    assert r.returncode != 0
    assert "bico stats: rank 1: statistic" in r.stderr, r.stderr
    assert str(bad) in r.stderr
    assert not os.path.exists(out) and not no_leftovers(d)


def test_usage_errors_match_serial(models):
    f = models["f"]
    r = mpi(2, "transfer", *COMMON(f), "--output", "x.st", ok=False)
    s = serial("transfer", *COMMON(f), "--output", "x.st", ok=False)
    assert r.returncode != 0 and s.returncode == 2
    assert "missing --method" in r.stderr and "missing --method" in s.stderr
    assert r.stderr.count("missing --method") == 1  # rank 0 alone says it
    r = mpi(2, "stats", "--source-calib", f["calA"], "--output", "x.st", ok=False)
    assert r.returncode != 0 and "missing --target-calib" in r.stderr
