"""bico-mpi: every rank must run the same plan (issue 22).  Ranks given
different options (mpirun's MPMD form "A : B") or different copies of an
input (the same relative path in another working folder, as a node-local
copy would be) used to finish with exit 0 and an output that differs from
the serial run; now every rank stops, rank 0 names the rank and what
differs, and nothing is written."""
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import planted as pl  # noqa: E402

BUILD = os.environ.get("BICO_BUILD", os.path.join(HERE, "..", "..", "build"))
BICO = os.path.join(BUILD, "bin", "bico")
BICO_MPI = os.environ.get("BICO_MPI", os.path.join(BUILD, "bin", "bico-mpi"))
MPIRUN = os.environ.get("MPIRUN", "mpirun")


def mpmd(apps, ok=True):
    """mpirun with one application context per (wdir, args): rank i runs
    apps[i]."""
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_btl_vader_single_copy_mechanism="none",
             OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = [MPIRUN, "--oversubscribe"]
    for i, (wdir, args) in enumerate(apps):
        if i:
            cmd.append(":")
        cmd += ["-np", "1", "--wdir", str(wdir), BICO_MPI, *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=60)
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture()
def run(tmp_path):
    """Two working folders, each with a source base, a target and a
    fine-tune under the same names (the second's fine-tune differs), and
    calibration files for stats."""
    rng = np.random.default_rng(5)
    shapes = {"l0.weight": (6, 4), "l0.bias": (6,), "l1.weight": (3, 6)}
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    tgt = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    cal = {"l0": rng.standard_normal((40, 4)).astype(np.float32)}
    dirs = []
    for i in range(2):
        d = tmp_path / f"node{i}"
        d.mkdir()
        pl.save(str(d / "A.safetensors"), base)
        pl.save(str(d / "B.safetensors"), tgt)
        ft = {k: v + (0.1 if i == 0 else 0.3) for k, v in base.items()}
        pl.save(str(d / "Aft.safetensors"), ft)
        c = {k: v + i for k, v in cal.items()}
        pl.save(str(d / "ca.safetensors"), c)
        pl.save(str(d / "cb.safetensors"), cal)
        dirs.append(d)
    return tmp_path, dirs


def args(out, alpha="1", tuned="Aft.safetensors"):
    return ["transfer", "--method", "naive", "--quiet", "--source-base",
            "A.safetensors", "--source-tuned", tuned, "--target-base",
            "B.safetensors", "--alpha", alpha, "--output", out]


def test_same_plan_on_every_rank_runs(run):
    root, (d0, d1) = run
    out = root / "ok.safetensors"
    mpmd([(d0, args(out)), (d0, args(out))])
    assert out.exists()


def test_ranks_given_different_options_stop(run):
    root, (d0, d1) = run
    out = root / "alpha.safetensors"
    r = mpmd([(d0, args(out, alpha="1")), (d0, args(out, alpha="2"))], ok=False)
    assert r.returncode != 0
    assert "rank 1" in r.stderr and "'2' here, '1' on rank 0" in r.stderr, r.stderr
    assert "same command" in r.stderr
    assert not out.exists()
    # another --source-tuned, named by another path
    os.link(d0 / "Aft.safetensors", d0 / "Aft2.safetensors")
    r = mpmd([(d0, args(out)), (d0, args(out, tuned="Aft2.safetensors"))],
             ok=False)
    assert r.returncode != 0 and "Aft2.safetensors" in r.stderr, r.stderr
    assert not out.exists()
    # a rank with an extra option
    r = mpmd([(d0, args(out)), (d0, args(out) + ["--workers", "1"])], ok=False)
    assert r.returncode != 0 and "more arguments" in r.stderr, r.stderr
    assert not out.exists()


def test_ranks_reading_different_copies_of_an_input_stop(run):
    """The same command, but rank 1's Aft.safetensors (its own node's copy)
    holds another fine-tune."""
    root, (d0, d1) = run
    out = root / "copies.safetensors"
    r = mpmd([(d0, args(out)), (d1, args(out))], ok=False)
    assert r.returncode != 0
    assert "rank 1" in r.stderr and "--source-tuned Aft.safetensors differs" \
        in r.stderr, r.stderr
    assert not out.exists()
    # identical copies in both folders are the same plan
    os.replace(d1 / "Aft.safetensors", d1 / "Aft_other.safetensors")
    os.link(d0 / "Aft.safetensors", d1 / "Aft.safetensors")
    mpmd([(d0, args(out)), (d1, args(out))])
    assert out.exists()


def test_stats_ranks_reading_different_calibration_stop(run):
    root, (d0, d1) = run
    out = root / "stats.safetensors"
    st = ["stats", "--source-calib", "ca.safetensors", "--target-calib",
          "cb.safetensors", "--output", out]
    r = mpmd([(d0, st), (d1, st)], ok=False)
    assert r.returncode != 0
    assert "rank 1" in r.stderr and "--source-calib ca.safetensors differs" \
        in r.stderr, r.stderr
    assert not out.exists()
