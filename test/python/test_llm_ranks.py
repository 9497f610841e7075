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
    import bico.llm as bl
    b = bl.load_model(pair / "B").state_dict()
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
    does not run across processes (--in-memory) is refused at once."""
    base = ["--source", "A/", "--source-tuned", "A_ft/", "--target", "B/",
            "--text", "task.txt", "--window", "32", "--threads", "1"]
    rs = _launch(["--method", "fit"] + base + ["--output", "B/inside/"], 2,
                 pair)
    for rc, o, e in rs:
        assert rc == 2, e
    assert "--output" in rs[0][2] and "rank 0: " in rs[1][2]
    assert not os.path.exists(str(pair / "B" / "inside"))
    rs = _launch(["--method", "auto", "--in-memory"] + base +
                 ["--output", str(tmp_path / "o") + "/"], 2, pair)
    for rc, o, e in rs:
        assert rc == 2 and "only the streamed routes run across" in e, e


def _merged_updates(folder):
    """{module: B A} of a PEFT adapter folder's pairs (float64)."""
    import numpy as np
    import bico.safetensors as st
    t = st.read(os.path.join(folder, "adapter_model.safetensors"))
    return {k[:-len(".lora_A.weight")]: t[k.replace("lora_A", "lora_B")]
            .astype(np.float64) @ t[k].astype(np.float64)
            for k in t if k.endswith(".lora_A.weight")}


@pytest.mark.parametrize("method", ["distill", "auto"])
def test_the_distillation_across_ranks_writes_the_one_process_adapter(
        pair, tmp_path, method):
    """--method distill (and auto: the streamed fit and the distillation)
    on 2 ranks: each keeps its rows of every batch (the teacher of those,
    its gradients summed), rank 0 writes the text the teacher writes and
    the output; the adapter's merged updates are the one-process run's to
    1e-3 of their largest (the issue's bound), the held-out lines the
    same, the other rank silent on stdout."""
    import numpy as np
    base = ["--method", method, "--source", "A/", "--source-tuned", "A_ft/",
            "--target", "B/", "--text", "task.txt", "--window", "32",
            "--threads", "1", "--rank", "4", "--steps", "60",
            "--generate", "16"]
    got = {}
    for size in (1, 2):
        dest = str(tmp_path / ("%s-%d" % (method, size))) + "/"
        rs = _launch(base + ["--output-lora", dest], size, pair)
        for rc, o, e in rs:
            assert rc == 0, e[-3000:]
        assert all(o == "" for _, o, _ in rs[1:])
        held = [ln for ln in rs[0][2].splitlines()
                if ln.startswith("held-out next-token loss")]
        assert held, rs[0][2]
        got[size] = (dest, rs[0][1], held)
        if size == 2 and method == "distill":
            assert "ranks: 2 processes" in rs[0][2] and \
                "generate: the teacher writes 16 windows" in rs[0][2]
    (d1, o1, h1), (d2, o2, h2) = got[1], got[2]
    assert o1.splitlines()[0] == o2.splitlines()[0] and h1 == h2
    if method == "distill":
        assert "chosen: distill" in o1       # a trained adapter compared
    u1, u2 = _merged_updates(d1), _merged_updates(d2)
    assert set(u1) == set(u2) and u1
    top = max(float(np.abs(v).max()) for v in u1.values())
    assert top > 0
    worst = max(float(np.abs(u2[k] - u1[k]).max()) for k in u1) / top
    assert worst <= 1e-3, worst


def test_a_rank_killed_in_the_distillation_ends_the_other(pair, tmp_path):
    """Rank 1 killed at its 20th distillation step: rank 0 ends within a
    minute with one line naming the collective (not a traceback, not a
    hang), and writes nothing."""
    out = tmp_path / "k"
    argv = ["--method", "distill", "--source", "A/", "--source-tuned",
            "A_ft/", "--target", "B/", "--text", "task.txt", "--window",
            "32", "--threads", "1", "--rank", "4", "--steps", "2000",
            "--generate", "16", "--output-lora", str(out) + "/"]
    started = _start([argv, argv], [pair, pair], [0, 1], 2,
                     envs={1: {"BICO_STREAM_TEST_KILL": "step:20"}})
    (rc0, err0, secs0), (rc1, _, _) = _ended(started, 240)
    assert rc1 == -9
    assert rc0 == 1 and secs0 < 60, (rc0, secs0)
    assert "across the ranks failed" in _one_line(err0), err0
    assert not out.exists()


def test_one_process_unless_asked(monkeypatch):
    """Ranks() is one process (the identity everywhere); Ranks(world=True)
    without a process group, a launcher variable out of range (WORLD_SIZE
    not a number, RANK missing or not below WORLD_SIZE, LOCAL_RANK
    likewise) and a timeout setting that is not a number of seconds above
    0 are refused by name."""
    from bico._status import BicoError, E_ARG
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
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BICO_RANKS_TIMEOUT",
              "BICO_RANKS_JOIN_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    assert R.launcher() == (0, 1, 0)
    assert R.timeouts() == (R.JOIN_TIMEOUT, R.TIMEOUT) == (300.0, 1800.0)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(BicoError, match="WORLD_SIZE"):
        R.world_size()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(BicoError, match="RANK is not set"):
        R.world_size()
    # the launcher's variables: integers, 0 <= RANK, LOCAL_RANK < 3
    for var, val, ok in (("RANK", "2", True), ("RANK", "3", False),
                         ("RANK", "-1", False), ("RANK", "1.0", False),
                         ("LOCAL_RANK", "2", True),
                         ("LOCAL_RANK", "3", False)):
        monkeypatch.setenv(var, val)
        if ok:
            assert R.world_size() == 3
        else:
            with pytest.raises(BicoError, match="%s=" % var) as e:
                R.world_size()
            assert e.value.status == E_ARG
            monkeypatch.setenv(var, "0")
    assert R.launcher() == (0, 3, 0)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "1")          # RANK 1 of one process
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(BicoError, match="RANK='1'"):
        R.world_size()
    for var in ("BICO_RANKS_TIMEOUT", "BICO_RANKS_JOIN_TIMEOUT"):
        monkeypatch.setenv(var, "2.5")
        assert 2.5 in R.timeouts()
        for bad in ("0", "-1", "x", "nan", "1e9"):
            monkeypatch.setenv(var, bad)
            with pytest.raises(BicoError, match=var):
                R.timeouts()
        monkeypatch.delenv(var)


# ---- the same run on every rank; joining and exchanges bounded ----
#
# Each run below is bounded by a subprocess timeout, so that a rank that
# waits forever (as before these checks) fails the test instead of
# hanging it.  The settings are short: BICO_RANKS_JOIN_TIMEOUT for the
# rendezvous, BICO_RANKS_TIMEOUT for each exchange.

FIT = ["--method", "fit", "--source", "A/", "--source-tuned", "A_ft/",
       "--target", "B/", "--window", "32", "--threads", "1"]
JOIN_S = 3         # BICO_RANKS_JOIN_TIMEOUT of these tests
STARTUP_S = 30     # a process's start (torch, bico) on a loaded machine


def _start(argvs, cwds, ranks, size, env=None, envs=None):
    """One `python3 -m bico.llm` per entry: argvs[i] run in cwds[i] as
    rank ranks[i] of `size`, with env (and envs[i]: rank i's own);
    [(Popen, start time)]."""
    import time
    port = _port()
    out = []
    for i, (argv, cwd, r) in enumerate(zip(argvs, cwds, ranks)):
        e = _rank_env(r, size, port)
        e.update(BICO_RANKS_JOIN_TIMEOUT=str(JOIN_S))
        e.update(env or {})
        e.update((envs or {}).get(i, {}))
        out.append((subprocess.Popen(
            [sys.executable, "-m", "bico.llm"] + argv, cwd=str(cwd), env=e,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            time.monotonic()))
    return out


def _ended(started, timeout):
    """[(exit status, stderr, seconds it ran)] of _start's processes, each
    bounded by timeout (all killed if one runs longer: the test fails)."""
    import time
    res = _wait([p for p, _ in started], timeout)
    now = time.monotonic()
    return [(rc, e, now - t0) for (rc, _, e), (_, t0) in zip(res, started)]


def _one_line(err):
    """The error line of a run that was refused or failed: the last line
    of its stderr, with no traceback before it."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines, err
    return lines[-1]


def _copy(pair, dest):
    import shutil
    shutil.copytree(str(pair), str(dest))
    return dest


def test_ranks_given_different_text_stop_before_work(pair, tmp_path):
    """Rank 1 given another --text (or the same path holding another
    text, as a node's own copy can): every rank stops before any work
    with exit status 2 and one line naming --text; nothing written."""
    other = _copy(pair, tmp_path / "node1")
    with open(str(other / "task.txt"), "a") as f:
        f.write("one more line on this node only\n")
    out = str(tmp_path / "out") + "/"
    for argv1, cwd1 in ((["--text", "eval.txt"], pair),
                        (["--text", "task.txt"], other)):
        res = _ended(_start([FIT + ["--text", "task.txt", "--output", out],
                             FIT + argv1 + ["--output", out]],
                            [pair, cwd1], [0, 1], 2), 120)
        for rc, err, _ in res:
            line = _one_line(err)
            assert rc == 2, err
            assert "rank 1: --text differs from rank 0's" in line, line
            assert "estimate" not in err and "fit:" not in err, err
        assert not os.path.exists(out)


def test_ranks_given_a_differing_model_file_stop(pair, tmp_path):
    """The same paths on both ranks, but rank 1's copy of a target file
    differs in one byte: every rank stops with exit status 2, naming
    --target and the file; an option that differs (--ridge) likewise."""
    other = _copy(pair, tmp_path / "node1")
    name = sorted(n for n in os.listdir(str(other / "B"))
                  if n.endswith(".safetensors"))[-1]
    with open(str(other / "B" / name), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    out = str(tmp_path / "out") + "/"
    argv = FIT + ["--text", "task.txt", "--output", out]
    res = _ended(_start([argv, argv], [pair, other], [0, 1], 2), 120)
    for rc, err, _ in res:
        line = _one_line(err)
        assert rc == 2, err
        assert "rank 1: --target differs from rank 0's: B/%s has another "\
            "size or content" % name in line, line
    res = _ended(_start([argv, argv + ["--ridge", "0.1"]], [pair, pair],
                        [0, 1], 2), 120)
    for rc, err, _ in res:
        assert rc == 2 and "rank 1: --ridge differs from rank 0's" in \
            _one_line(err), err
    assert not os.path.exists(out)


def test_identical_copies_at_other_paths_run(pair, tmp_path):
    """Rank 1 reads its own copy of the folders and the text at other
    (absolute) paths, with its own --threads and --spill-dir: the same
    content, so the run goes on and rank 0 writes the output."""
    other = _copy(pair, tmp_path / "node1")
    out = str(tmp_path / "out") + "/"
    spill = tmp_path / "spill1"
    spill.mkdir()
    argv1 = ["--method", "fit", "--source", str(other / "A"),
             "--source-tuned", str(other / "A_ft"), "--target",
             str(other / "B"), "--window", "32", "--threads", "2",
             "--text", str(other / "task.txt"), "--spill-dir", str(spill),
             "--output", str(tmp_path / "ignored") + "/"]
    res = _ended(_start([FIT + ["--text", "task.txt", "--output", out],
                         argv1], [pair, tmp_path], [0, 1], 2), 300)
    for rc, err, _ in res:
        assert rc == 0, err[-3000:]
    assert os.path.isdir(out) and not os.path.exists(
        str(tmp_path / "ignored"))


def test_a_missing_rank_ends_the_others_within_the_join_timeout(pair):
    """Only rank 0 of 2 started: it ends with exit status 1 and one line
    naming rank 1 and the setting, within BICO_RANKS_JOIN_TIMEOUT (3 s
    here) of joining; only rank 1 started: it ends likewise, naming rank
    0's rendezvous."""
    argv = FIT + ["--text", "task.txt", "--output", "never/"]
    for r, want in ((0, "rank 1 of WORLD_SIZE=2 did not join within 3 s "
                        "(BICO_RANKS_JOIN_TIMEOUT)"),
                    (1, "rank 0's rendezvous at 127.0.0.1:")):
        (rc, err, took), = _ended(_start([argv], [pair], [r], 2), 120)
        assert rc == 1, err
        assert want in _one_line(err), err
        assert len(err.strip().splitlines()) == 1, err
        assert took < JOIN_S + STARTUP_S, took
    assert not os.path.exists(str(pair / "never"))


def test_misnumbered_ranks_are_refused(pair):
    """RANK=5 of WORLD_SIZE=2 (and a RANK that is no number, a LOCAL_RANK
    out of range) is refused at once with exit status 2 naming the
    variable; two processes with RANK=1 of 2 (no rank 0) end within the
    join timeout; ranks 0, 1, 1 of 3: RANK=1 is named as given twice."""
    argv = FIT + ["--text", "task.txt", "--output", "never/"]
    for var, val in (("RANK", "5"), ("RANK", "one"), ("LOCAL_RANK", "-1"),
                     ("WORLD_SIZE", "0")):
        (rc, err, _), = _ended(_start([argv], [pair], [0], 2,
                                      env={var: val}), 120)
        assert rc == 2, err
        line = _one_line(err)
        assert len(err.strip().splitlines()) == 1, err
        assert "%s=%r: not an integer" % (var, val) in line, line
    res = _ended(_start([argv, argv], [pair, pair], [1, 1], 2), 120)
    for rc, err, took in res:
        assert rc == 1 and "rank 0's rendezvous" in _one_line(err), err
        assert took < JOIN_S + STARTUP_S, took
    res = _ended(_start([argv] * 3, [pair] * 3, [0, 1, 1], 3), 120)
    twice = "RANK=1: two processes of this run (WORLD_SIZE=3)"
    assert res[0][0] == 2 and twice in _one_line(res[0][1]), res[0][1]
    assert any(rc == 2 and twice in _one_line(e) for rc, e, _ in res[1:])
    for rc, err, took in res:
        assert rc != 0 and took < JOIN_S + STARTUP_S, (err, took)
        _one_line(err)
    assert not os.path.exists(str(pair / "never"))


def _state(pid):
    """The state letter of a process (/proc/PID/stat), "" once gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_a_stopped_rank_ends_the_other_within_the_timeout(pair, tmp_path):
    """Rank 1 stops itself (SIGSTOP) at its second fitted layer: rank 0,
    waiting for it in the fit's exchange, ends within BICO_RANKS_TIMEOUT
    (15 s here) with exit status 1 and one line naming the setting, and
    writes nothing; rank 1, continued (SIGCONT), ends too."""
    import signal
    import time
    timeout = 15
    out = str(tmp_path / "out") + "/"
    argv = FIT + ["--text", "task.txt", "--output", out]
    started = _start([argv, argv], [pair, pair], [0, 1], 2,
                     env={"BICO_RANKS_TIMEOUT": str(timeout)},
                     envs={1: {"BICO_STREAM_TEST_KILL": "fit:2:STOP"}})
    p0, p1 = started[0][0], started[1][0]
    try:
        deadline = time.monotonic() + 240
        while _state(p1.pid) != "T":
            assert p1.poll() is None and p0.poll() is None, \
                (p0.poll(), p1.poll())
            assert time.monotonic() < deadline, "rank 1 never stopped"
            time.sleep(0.1)
        stopped = time.monotonic()
        try:
            _, e0 = p0.communicate(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            raise AssertionError("rank 0 still waits %d s after rank 1 "
                                 "stopped" % (timeout + 60))
        took = time.monotonic() - stopped
        assert p0.returncode == 1, e0
        assert "within %d s (BICO_RANKS_TIMEOUT)" % timeout in \
            _one_line(e0), e0
        assert took < timeout + 20, took
        os.kill(p1.pid, signal.SIGCONT)
        _, e1 = p1.communicate(timeout=60)
        assert p1.returncode == 1, e1
        assert "across the ranks failed" in _one_line(e1), e1
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    assert not os.path.exists(out)


def test_transfer_model_ranks_given_different_inputs_stop(pair, tmp_path):
    """transfer_model on folders across 2 ranks: rank 1's batches from
    another text, or its copy of a target file differing in one byte,
    stop every rank before any work (the BicoError naming the argument,
    the same on both ranks)."""
    texts = _copy(pair, tmp_path / "text1")
    with open(str(texts / "task.txt"), "a") as f:
        f.write("one more line on this node only\n")
    files = _copy(pair, tmp_path / "files1")
    name = sorted(n for n in os.listdir(str(files / "B"))
                  if n.endswith(".safetensors"))[0]
    with open(str(files / "B" / name), "r+b") as f:
        f.seek(-2, os.SEEK_END)
        b = f.read(1)
        f.seek(-2, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    for other, want in ((texts, "rank 1: batches differs from rank 0's"),
                        (files, "rank 1: target differs from rank 0's: %s "
                         "has another size or content" % os.path.join(
                             str(files / "B"), name))):
        port = _port()
        out = str(tmp_path / ("ret-%s" % other.name))
        procs = []
        for r, d in enumerate((pair, other)):
            e = _rank_env(r, 2, port)
            e.update(BICO_RANKS_JOIN_TIMEOUT=str(JOIN_S))
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE,
                                              "ranks_transfer_child.py"),
                 str(d), "-", out], env=e, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE))
        for rc, _, err in _wait(procs, 120):
            assert rc == 0, err.decode()[-3000:]
        for r in range(2):
            got = torch.load("%s.%d" % (out, r))["ret"]
            assert want in got["error"], got["error"]


def test_fingerprints_sample_what_they_say(tmp_path):
    """fingerprint_file: the size, the first 64 KiB, 16 pieces of 256
    bytes and the last 4 KiB; a byte elsewhere is not read.  A folder's:
    its regular files by name (dot files and subfolders left out), the
    same for a copy at another path; --text: every byte the run reads."""
    from bico.llm import agree as R
    from bico.llm.text import text_spans
    size = 1 << 20
    data = bytearray(os.urandom(size))
    a = tmp_path / "a" / "w.bin"
    a.parent.mkdir()
    a.write_bytes(bytes(data))
    fa = R.fingerprint_file(str(a))
    spans = R._sampled(size)
    assert spans[0] == (0, 64 << 10) and spans[-1] == (size - 4096, 4096)
    assert len(spans) == 18 and all(n == 256 for _, n in spans[1:-1])
    sampled = set()
    for at, n in spans:
        sampled.update(range(at, at + n))
    outside = next(i for i in range(65536, size) if i not in sampled)
    for pos, caught in ((10, True), (spans[5][0] + 3, True),
                        (size - 1, True), (outside, False)):
        d = bytearray(data)
        d[pos] ^= 0xFF
        b = tmp_path / "b.bin"
        b.write_bytes(bytes(d))
        assert (R.fingerprint_file(str(b)) != fa) == caught, pos
    b.write_bytes(bytes(data[:-1]))             # one byte shorter
    assert R.fingerprint_file(str(b)) != fa
    # a folder: by name and content; a copy elsewhere agrees
    c = tmp_path / "c"
    c.mkdir()
    (c / "w.bin").write_bytes(bytes(data))
    (c / ".hidden").write_bytes(b"x")
    (c / "sub").mkdir()
    (pa, da), (pc, dc) = R.fingerprint(str(a.parent)), R.fingerprint(str(c))
    assert da == dc == {"w.bin": fa} and pa != pc
    assert R.fingerprint(str(tmp_path / "none"))[1] == "missing"
    assert R.fingerprint(None) is None
    # --text: every byte read_text reads (here, past the sampled ones)
    t = tmp_path / "t.txt"
    t.write_bytes(bytes(data))
    ft = R.text_fingerprint(str(t), size)
    d = bytearray(data)
    d[outside] ^= 0xFF
    t.write_bytes(bytes(d))
    assert R.text_fingerprint(str(t), size) != ft
    assert text_spans(size, size) == [(0, size)]
    assert len(text_spans(size, 1 << 16)) == 1024
