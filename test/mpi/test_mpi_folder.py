"""bico-mpi (issue 32): `--config` works as in the serial command (every
rank refused it before, while the help listed it), the output folder's
lock is held by rank 0 for the whole run, and messages carry no library
function names."""
import fcntl
import os
import shutil
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


def env():
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
             OMPI_MCA_btl_vader_single_copy_mechanism="none",
             OMPI_MCA_rmaps_base_oversubscribe="1")
    return e


def mpi(apps, cwd=None):
    """mpirun; apps: [(wdir, args)] one application context per rank, or a
    list of args for 2 ranks in cwd."""
    cmd = [MPIRUN, "--oversubscribe"]
    if apps and isinstance(apps[0], tuple):
        for i, (wdir, args) in enumerate(apps):
            if i:
                cmd.append(":")
            cmd += ["-np", "1", "--wdir", str(wdir), BICO_MPI,
                    *map(str, args)]
    else:
        cmd += ["-np", "2", BICO_MPI, *map(str, apps)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(),
                          timeout=120, cwd=cwd)


CONFIG = """method: naive
alpha: {alpha}
source_base: A.safetensors
source_tuned: Aft.safetensors
target_base: B.safetensors
"""


@pytest.fixture()
def nodes(tmp_path):
    rng = np.random.default_rng(32)
    shapes = {"l0.weight": (6, 4), "l0.bias": (6,), "l1.weight": (3, 6)}
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    tgt = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    ft = {k: v + 0.25 for k, v in base.items()}
    dirs = []
    for i in range(2):
        d = tmp_path / ("node%d" % i)
        d.mkdir()
        pl.save(str(d / "A.safetensors"), base)
        pl.save(str(d / "Aft.safetensors"), ft)
        pl.save(str(d / "B.safetensors"), tgt)
        (d / "c.yaml").write_text(CONFIG.format(alpha=0.5 if i == 0 else 2))
        dirs.append(d)
    return tmp_path, dirs


def test_config_runs_as_the_serial_command(nodes):
    root, (d0, _) = nodes
    r = mpi(["transfer", "--config", "c.yaml", "--quiet", "--output",
             "mpi.safetensors"], cwd=d0)
    assert r.returncode == 0, r.stdout + r.stderr
    s = subprocess.run([BICO, "transfer", "--config", "c.yaml", "--quiet",
                        "--output", "serial.safetensors"], cwd=d0,
                       capture_output=True, text=True, timeout=60)
    assert s.returncode == 0, s.stderr
    assert (d0 / "mpi.safetensors").read_bytes() == \
        (d0 / "serial.safetensors").read_bytes()


def test_a_config_that_differs_between_nodes_stops_every_rank(nodes):
    root, (d0, d1) = nodes
    out = root / "out.safetensors"
    args = ["transfer", "--config", "c.yaml", "--quiet", "--output", out]
    r = mpi([(d0, args), (d1, args)])
    assert r.returncode != 0
    assert "bico transfer: rank 1: its command line differs from rank 0's" \
        in r.stderr, r.stderr
    assert "(after --config)" in r.stderr, r.stderr
    assert not out.exists()


def test_an_output_folder_held_by_another_run_is_refused(nodes, tmp_path):
    root, (d0, _) = nodes
    out = d0 / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    # another run holds it, by the documented protocol (bico(1)): an
    # exclusive flock on .out.bico-lock, which names the holder
    fd = os.open(str(d0 / ".out.bico-lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"%d\nthe holder's command\n" % os.getpid())
        r = mpi(["transfer", "--config", "c.yaml", "--quiet", "--output",
                 "out/"], cwd=d0)
    finally:
        os.unlink(str(d0 / ".out.bico-lock"))
        os.close(fd)
    assert r.returncode != 0
    assert "is being written by another run (pid %d" % os.getpid() in \
        r.stderr, r.stderr
    assert "that run's command: the holder's command" in r.stderr, r.stderr
    assert "folder_begin" not in r.stderr and "folder_wait" not in r.stderr
    assert sorted(os.listdir(str(out))) == ["notes.txt"]
    r = mpi(["transfer", "--config", "c.yaml", "--quiet", "--output", "out/"],
            cwd=d0)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(str(out))) == ["model.safetensors", "notes.txt"]
    assert [n for n in os.listdir(str(d0)) if ".bico-" in n] == []


def test_messages_name_no_library_function(nodes):
    """Before: "rank 0: bico_stwriter_create_folder: cannot write the output
    folder ..." (the parent refuses new entries: chattr +i)."""
    root, (d0, _) = nodes
    parent = d0 / "locked"
    parent.mkdir()
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(parent)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (root on ext4 or alike)")
    try:
        r = mpi(["transfer", "--config", "c.yaml", "--quiet", "--output",
                 "locked/out/"], cwd=d0)
    finally:
        subprocess.run(["chattr", "-i", str(parent)])
    assert r.returncode != 0
    assert "cannot write the output folder locked/out" in r.stderr, r.stderr
    assert "stwriter_create_folder" not in r.stderr, r.stderr
    assert os.listdir(str(parent)) == []
