"""The streamed runner across processes (bico.llm.ranks): 2 and 3 gloo
ranks, each running its share of the calibration batches, give the
one-process run's results up to the order in which sums add up; every
rank holds the same result bit for bit; a run with fewer batches than
ranks is refused on every rank; a rank that dies stops the others.

The reference is the same runner in one process (no process group), whose
equality with the in-memory route test_llm_stream.py checks."""
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import llama  # noqa: E402

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed without gloo", allow_module_level=True)
if "libasan" in os.environ.get("LD_PRELOAD", ""):
    # gloo's threads throw C++ exceptions, which a preloaded ASan runtime
    # cannot intercept (its real __cxa_throw is unset: CHECK failed in
    # asan_interceptors.cpp); the plain `make check` runs these
    pytest.skip("torch.distributed under a preloaded ASan runtime",
                allow_module_level=True)

CHILD = os.path.join(HERE, "ranks_child.py")
GRID = [0.0, 0.5, 1.0]


def _folders(d, tied, seed):
    return llama.random_pair(d, torch.Generator().manual_seed(seed), 48,
                             a=(16, 24, 2), b=(24, 40, 3), tied=tied,
                             batches=(8, 3, 13))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for tied in (True, False):
        d = tmp_path_factory.mktemp("ranks_tied" if tied else "ranks_untied")
        out[tied] = (d, _folders(d, tied, 3 if tied else 4))
    return out


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(d, batches, size, tmp, kind="model", ridge=1e-2, n_held=2,
         env_extra=None, timeout=300):
    spec = str(tmp / ("spec-%s-%d.pt" % (kind, size)))
    torch.save({"batches": batches[:len(batches) - n_held],
                "held": batches[len(batches) - n_held:], "kind": kind,
                "ridge": ridge, "grid": GRID}, spec)
    out = str(tmp / ("out-%s-%d" % (kind, size)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    port = _port()
    for r in range(size):
        e = dict(env)
        if size > 1:
            e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     RANK=str(r), WORLD_SIZE=str(size))
        if env_extra and r in env_extra:
            e.update(env_extra[r])
        procs.append(subprocess.Popen(
            [sys.executable, CHILD, str(d), spec, out], env=e,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    res = [(rc, e.decode()) for rc, _, e in _wait(procs, timeout)]
    outs = [torch.load("%s.%d" % (out, r)) if os.path.exists(
        "%s.%d" % (out, r)) else None for r in range(size)]
    return res, outs


def _wait(procs, timeout):
    """[(exit status, stdout, stderr)] of the ranks' processes; all killed
    if one takes longer than timeout seconds."""
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank did not finish in %d s" % timeout)
        out.append((p.returncode, o, e))
    return out


def _close(a, b, rel=1e-5):
    a, b = a.double(), b.double()
    return float((a - b).abs().max()) <= rel * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("size", [2, 3])
def test_ranks_give_the_one_process_fit(folders, tmp_path, tied, size):
    """The fit's tensors, the carried norms and embedding, the held-out
    scores of every alpha and every window's loss: the one-process run's
    to 1e-5 relative (the sums' order differs); the same on every rank,
    bit for bit; the fit report's rows count every batch."""
    d, batches = folders[tied]
    ok, one = _run(d, batches, 1, tmp_path)
    assert ok[0][0] == 0, ok[0][1]
    st, outs = _run(d, batches, size, tmp_path)
    for rc, err in st:
        assert rc == 0, err
    want = one[0]
    for o in outs:
        assert o["size"] == size
        assert set(o["tensors"]) == set(want["tensors"])
        for k, v in want["tensors"].items():
            assert _close(o["tensors"][k], v), (k, tied, size)
            # every rank: rank 0's values, bit for bit
            assert torch.equal(o["tensors"][k], outs[0]["tensors"][k]), k
        for a in GRID:
            assert len(o["scores"][a]) == len(want["scores"][a]) == 2
            for (l1, n1), (l2, n2) in zip(o["scores"][a], want["scores"][a]):
                assert n1 == n2 and abs(l1 - l2) < 1e-5
            assert len(o["windows"][a]) == 6
            for w1, w2 in zip(o["windows"][a], want["windows"][a]):
                assert abs(w1 - w2) < 1e-5
        rows = [(e["name"], e["rows"]) for e in o["report"]]
        assert rows == [(e["name"], e["rows"]) for e in want["report"]]
    assert not torch.equal(want["tensors"]["model.layers.0.mlp.down_proj"
                                           ".weight"],
                           torch.zeros(1)), "a fit happened"


def test_ranks_give_the_one_process_adapter(folders, tmp_path):
    """kind "adapter": the rank-r pairs (weighted by the inputs of every
    rank) are the one-process run's: their products to 1e-5."""
    d, batches = folders[True]
    ok, one = _run(d, batches, 1, tmp_path, kind="adapter")
    assert ok[0][0] == 0, ok[0][1]
    st, outs = _run(d, batches, 2, tmp_path, kind="adapter")
    for rc, err in st:
        assert rc == 0, err
    want = one[0]["tensors"]
    mods = [k[:-2] for k in want if k.endswith("/B")]
    assert len(mods) == 21
    for o in outs:
        for m in mods:
            p1 = o["tensors"][m + "/B"] @ o["tensors"][m + "/A"]
            p0 = want[m + "/B"] @ want[m + "/A"]
            assert _close(p1, p0), m


def test_fewer_batches_than_ranks_is_refused_on_every_rank(folders,
                                                            tmp_path):
    d, batches = folders[True]
    st, outs = _run(d, batches[:4], 3, tmp_path, n_held=2)
    for rc, err in st:
        assert rc != 0
        assert "2 calibration batches for 3 ranks" in err, err
    assert outs == [None, None, None]


def test_a_rank_that_dies_stops_the_others(folders, tmp_path):
    """Rank 1 killed at its third fitted layer: the other ranks fail
    (gloo: the peer's connection closed) instead of waiting, and write
    nothing."""
    d, batches = folders[True]
    st, outs = _run(d, batches, 3, tmp_path,
                    env_extra={1: {"BICO_STREAM_TEST_KILL": "fit:3"}},
                    timeout=240)
    assert st[1][0] == -9
    for r in (0, 2):
        assert st[r][0] != 0
        # a line naming the collective, not a traceback from gloo
        assert "across the ranks failed" in st[r][1], st[r][1]
    assert outs == [None, None, None]


PRIMITIVES = r"""
import datetime, sys
import numpy as np, torch, torch.distributed as dist
import bico
from bico._status import BicoError, E_NUMERIC
from bico.llm.ranks import Ranks
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
r = Ranks(world=True)
R = r.size
assert r.total(r.rank + 1) == R * (R + 1) // 2
# gather: the values in the order of their global indices
mine = r.share(list(range(10)))
assert r.gather([(i, x * x) for i, x in mine]) == [x * x for x in range(10)]
g = r.gather_root([(i, -x) for i, x in mine])
assert (g is None) == (r.rank != 0)
assert g is None or g == [-x for x in range(10)]
# from_root: rank 0's arrays everywhere
a, none, b = r.from_root(lambda: (np.arange(6.0).reshape(2, 3), None,
                                  np.array([7], dtype=np.int64)))
assert none is None and a.shape == (2, 3) and a[1, 2] == 5.0 and b[0] == 7
# the sum of a float64 statistic on rank 0 only
s = r.sum_root(torch.full((2, 2), float(r.rank + 1), dtype=torch.float64))
assert (s is None) == (r.rank != 0)
if s is not None:
    assert float(s[0, 0]) == R * (R + 1) / 2
# an error on rank 0 reaches every rank, with its status
def fail():
    raise BicoError(E_NUMERIC, "planted failure")
try:
    r.from_root(fail)
    sys.exit(3)
except BicoError as e:
    assert e.status == E_NUMERIC and "planted failure" in str(e), e
# same(): equal values pass, a difference stops every rank
r.same("equal", [torch.ones(3)])
try:
    r.same("planted values", [torch.full((3,), float(r.rank == 1))])
    sys.exit(4)
except BicoError as e:
    assert "planted values differ between ranks (rank 1" in str(e), e
from bico.llm.ranks import leave
leave(0)
"""


def test_the_collectives_on_planted_values():
    """Ranks' primitives on 2 and 3 gloo ranks: a total, values gathered
    in their global order, rank 0's arrays sent to every rank, a sum on
    rank 0, rank 0's error raised on every rank with its status, and the
    digest check passing on equal values and stopping every rank on a
    planted difference."""
    for size in (2, 3):
        port = _port()
        procs = [subprocess.Popen(
            [sys.executable, "-c", PRIMITIVES],
            env=dict(os.environ, MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), RANK=str(r),
                     WORLD_SIZE=str(size), OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for r in range(size)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()


# ---- python3 -m bico.llm under a launcher (torchrun's environment) ----

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """llm_pair's folders (Qwen2-style, tied, BF16; a LoRA-tuned
    source): a fit that helps on the held-out windows."""
    import llm_pair
    d = tmp_path_factory.mktemp("ranks_pair")
    llm_pair.make(str(d))
    return d


def _launch(args, size, cwd, timeout=300):
    """python3 -m bico.llm args as `size` ranks with the variables
    torchrun sets (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE): [(exit
    status, stdout, stderr)] by rank.  One process: no such variables."""
    port = _port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "bico.llm"] + args, cwd=str(cwd),
        env=_rank_env(r, size, port), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for r in range(size)]
    return _wait(procs, timeout)


def _rank_env(r, size, port):
    """Rank r's environment of `size` as torchrun sets it (MASTER_ADDR/
    PORT, RANK, LOCAL_RANK, WORLD_SIZE); one process: none of them."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    if size > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(size))
    return env


def _bf16_close(a, b):
    """Two BF16 arrays (read as float32) equal up to one rounding step at
    each element's magnitude, and apart in at most 1 of 100 elements."""
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    step = np.exp2(np.floor(np.log2(np.maximum(np.abs(b), 1e-30))) - 7)
    apart = a != b
    return bool(np.all(np.abs(a - b) <= step * 1.0001)) and \
        apart.mean() <= 0.01


def test_the_command_across_ranks_writes_the_one_process_output(pair,
                                                                tmp_path):
    """--method fit across 2 ranks: the same choice (the lines of stdout),
    one output written by rank 0 (the other ranks print nothing), its
    tensors the one-process run's up to a BF16 rounding step in a few
    elements; the adapter's pairs likewise to 1e-2 of their largest."""
    import numpy as np
    import bico.safetensors as st
    base = ["--method", "fit", "--source", "A/", "--source-tuned", "A_ft/",
            "--target", "B/", "--text", "task.txt", "--window", "32",
            "--threads", "1"]
    for out_opt in ("--output", "--output-lora"):
        got = {}
        for size in (1, 2):
            dest = str(tmp_path / ("%s-%d" % (out_opt[2:], size))) + "/"
            rs = _launch(base + [out_opt, dest] +
                         (["--rank", "4"] if out_opt == "--output-lora"
                          else []), size, pair)
            for rc, o, e in rs:
                assert rc == 0, e[-3000:]
            assert all(o == "" for _, o, _ in rs[1:])
            assert "ranks: 2 processes" in rs[0][2] or size == 1
            got[size] = (dest, rs[0][1])
        (d1, o1), (d2, o2) = got[1], got[2]
        assert o1.splitlines()[:2] == o2.splitlines()[:2], (o1, o2)
        assert "chosen: fit" in o1     # the fit helps: a real comparison
        assert sorted(os.listdir(d1)) == sorted(os.listdir(d2))
        for n in os.listdir(d1):
            if not n.endswith(".safetensors"):
                continue
            a, b = st.read(d2 + n), st.read(d1 + n)
            assert list(a) == list(b)
            for k in b:
                assert a[k].dtype == b[k].dtype
                if out_opt == "--output":
                    assert _bf16_close(a[k], b[k]), k
                else:
                    np.testing.assert_allclose(
                        a[k], b[k], rtol=0,
                        atol=1e-2 * float(np.abs(b[k]).max()) + 1e-12)


def _transfer(pair, dest, size, tmp, timeout=300):
    """ranks_transfer_child.py as `size` ranks: [(exit status, stderr)]
    and each rank's return value (or {"error": message})."""
    port = _port()
    out = str(tmp / ("ret-%d-%s" % (size, "sd" if dest == "-" else
                                    os.path.basename(dest.rstrip("/")))))
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(HERE, "ranks_transfer_child.py"),
         str(pair), dest, out], env=_rank_env(r, size, port),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(size)]
    res = [(rc, e.decode()) for rc, _, e in _wait(procs, timeout)]
    got = [torch.load("%s.%d" % (out, r)) for r in range(size)
           if os.path.exists("%s.%d" % (out, r))]
    assert len(got) == size, res
    # under the launcher's variables every rank joined one group
    assert all(g["joined"] == (size > 1) and g["size"] == size
               for g in got), res
    return res, [g["ret"] for g in got]


def test_transfer_model_on_folders_across_ranks(pair, tmp_path):
    """transfer_model on folders under torchrun's variables shares the
    batches among the ranks: the state dict on every rank is the
    one-process result to 1e-5 (the sums' order differs) and the same on
    every rank bit for bit; with output=, rank 0 writes the one-process
    folder (up to a BF16 rounding step in a few elements), every rank
    returns the same choice; an output inside an input is refused on
    every rank, the others naming rank 0."""
    import bico.safetensors as st
    (rc1, e1), = _transfer(pair, "-", 1, tmp_path)[0]
    assert rc1 == 0, e1[-3000:]
    one = torch.load(str(tmp_path / "ret-1-sd.0"))["ret"]
    st2, outs = _transfer(pair, "-", 2, tmp_path)
    for rc, e in st2:
        assert rc == 0, e[-3000:]
    assert set(outs[0]) == set(one) == set(outs[1])
    for k, v in one.items():
        assert _close(outs[0][k], v), k
        assert torch.equal(outs[0][k], outs[1][k]), k
    import bico.torch as bt
    b = bt.load_model(pair / "B").state_dict()
    moved = sum(not torch.equal(one[k], b[k]) for k in b)
    assert moved > 10       # the fit moved the target: a real comparison
    got = {}
    for size in (1, 2):
        dest = str(tmp_path / ("out%d" % size)) + "/"
        rs, rets = _transfer(pair, dest, size, tmp_path)
        for rc, e in rs:
            assert rc == 0, e[-3000:]
        assert all(r == rets[0] for r in rets), rets
        got[size] = (dest, rets[0])
    (d1, r1), (d2, r2) = got[1], got[2]
    assert r1["alpha"] == r2["alpha"] and r1["ridge"] == r2["ridge"]
    assert sorted(os.listdir(d1)) == sorted(os.listdir(d2))
    files = [n for n in os.listdir(d1) if n.endswith(".safetensors")]
    assert files
    for n in files:
        a2, a1 = st.read(d2 + n), st.read(d1 + n)
        assert list(a1) == list(a2)
        for k in a1:
            assert _bf16_close(a2[k], a1[k]), k
    rs, rets = _transfer(pair, str(pair / "B" / "inside") + "/", 2,
                         tmp_path)
    for rc, e in rs:
        assert rc == 0, e[-3000:]
    assert "output" in rets[0]["error"] and \
        rets[1]["error"].startswith("rank 0: ")
    assert not os.path.exists(str(pair / "B" / "inside"))


def test_the_command_across_ranks_refuses_together(pair, tmp_path):
    """A refusal on rank 0 (an output inside an input) ends every rank
    with exit status 2, the others naming rank 0's reason; a route that
    does not run across processes (--method auto) is refused at once."""
    base = ["--source", "A/", "--source-tuned", "A_ft/", "--target", "B/",
            "--text", "task.txt", "--window", "32", "--threads", "1"]
    rs = _launch(["--method", "fit"] + base + ["--output", "B/inside/"], 2,
                 pair)
    for rc, o, e in rs:
        assert rc == 2, e
    assert "--output" in rs[0][2] and "rank 0: " in rs[1][2]
    assert not os.path.exists(str(pair / "B" / "inside"))
    rs = _launch(["--method", "auto"] + base +
                 ["--output", str(tmp_path / "o") + "/"], 2, pair)
    for rc, o, e in rs:
        assert rc == 2 and "only the streamed fit runs across" in e, e


def test_one_process_unless_asked(monkeypatch):
    """Ranks() is one process (the identity everywhere); Ranks(world=True)
    without a process group, and a WORLD_SIZE that is not a number, are
    refused by name."""
    from bico._status import BicoError
    from bico.llm import ranks as R
    r = R.Ranks()
    assert (r.rank, r.size, r.root) == (0, 1, True)
    assert r.total(5) == 5 and r.gather([(1, "b"), (0, "a")]) == ["a", "b"]
    assert r.share([7, 8, 9]) == [(0, 7), (1, 8), (2, 9)]
    assert r.agree(None) is None and r.agree("x") == (0, "x")
    assert R.leave(0) is None           # one process: nothing to end
    if not dist.is_initialized():
        with pytest.raises(BicoError, match="not initialised"):
            R.Ranks(world=True)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(BicoError, match="WORLD_SIZE"):
        R.world_size()
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert R.world_size() == 3
