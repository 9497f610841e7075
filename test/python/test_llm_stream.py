"""The streamed runner (bico.llm.runtime, stream.stats, stream.fit,
stream.out, stream.route): decoders run a block at a time from their
folders give the in-memory route's results, hold what grows with depth in
a spill store that leaves nothing behind, and leave no partial output
when killed.

References are computed independently of the code under test: the
in-memory route on nn.Modules (bico.torch.transfer_model, bico.llm with
--in-memory), load_model's whole-model forward, and the store's own
bytes compared with what went in."""
import json
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import bico.safetensors as st
import bico.llm as bl
import bico.torch as bt
from bico._status import BicoError
from bico.llm import families as fam
from bico.llm import runtime as rt
from bico.llm.stream.route import StreamedFit

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402
import llm_pair  # noqa: E402

torch.set_num_threads(1)
# the fit route (--method fit) streams; distill and auto hold the models
PY = [sys.executable, "-m", "bico.llm", "--method", "fit"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """llm_pair's folders (Qwen2-style, tied, sharded BF16, 16 -> 32
    wide, 2 -> 3 layers) plus A_full: a full fine-tune of A (norms and
    the embedding move too, so BiCo's carried tensors matter)."""
    d = tmp_path_factory.mktemp("stream")
    info = llm_pair.make(str(d))
    text = open(d / "task.txt").read()
    full = llm_pair.bf16(llm_pair.train_full(
        llm_pair.CFG_A, info["sa"], llm_pair.byte_ids(text), steps=40))
    llm_pair.write_model(str(d / "A_full"), llm_pair.CFG_A, full)
    return d


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """A Llama pair with untied heads (F32 folders, GQA, no biases)."""
    d = tmp_path_factory.mktemp("untied")
    batches = llama.random_pair(d, torch.Generator().manual_seed(5), 64,
                                a=(16, 24, 3), b=(24, 40, 2))
    return d, batches


def cal_of(d, **kw):
    return bl.text_batches(str(d / "task.txt"), 32, tokenizer=str(d / "B"),
                           batch_size=8, **kw)


def models(d, tuned="A_full"):
    return tuple(bl.load_model(d / f, dtype=torch.float32)
                 for f in ("A", tuned, "B"))


# ---- the pieces ----

def test_stages_and_config_equal_load_model(pair, untied):
    for folder in (pair / "B", untied[0] / "B"):
        m = bl.load_model(folder, dtype=torch.float32)
        f = rt.Folder(folder, torch.float32)
        assert f.cfg == m.model.cfg
        x = torch.randint(0, f.shapes[f.embed_name()][0], (3, 9))
        with torch.no_grad():
            h = rt.embed(f.cfg, f.rows(f.embed_name(), x.reshape(-1))
                         .reshape(3, 9, -1))
            assert torch.equal(h, m.model.embed_tokens(x))
            pe, mask = fam.positions(f.cfg, 9, h)
            for i in range(f.L):
                want = m.model.layers[i](h, attention_mask=mask,
                                         position_embeddings=pe)[0]
                got = rt.stages(f.layer(i), h, pe, mask)
                assert torch.equal(got["out"], want), i
                h = want
        f.close()


def test_folder_reads_rows_and_refuses_bad_ids(pair):
    f = rt.Folder(pair / "B", torch.float32)
    table = bl.load_model(pair / "B", dtype=torch.float32) \
        .model.embed_tokens.weight.detach()
    ids = torch.tensor([5, 3, 3, 200, 4, 0])
    assert torch.equal(f.rows(f.embed_name(), ids), table[ids])
    with pytest.raises(BicoError, match="outside the vocabulary"):
        f.rows(f.embed_name(), torch.tensor([256]))
    f.close()


def test_spill_store_keeps_the_budget_and_leaves_no_file(tmp_path):
    before = set(os.listdir(tmp_path))
    s = rt.SpillStore(budget=4000, folder=str(tmp_path))
    g = torch.Generator().manual_seed(1)
    vals = {i: torch.randn(10 + i, 30, generator=g) for i in range(6)}
    for i, v in vals.items():
        s.put(("k", i), v)
    assert s.used <= 4000 and s.disk and s.mem      # both places used
    assert set(os.listdir(tmp_path)) == before      # the file has no name
    for i, v in vals.items():
        assert torch.equal(s.get(("k", i)), v)
        ids = torch.tensor([0, 7, 3])
        assert torch.equal(s.rows(("k", i), ids), v[ids])
        assert torch.equal(s.slice(("k", i), 2, 5), v[2:5])
    end = s.end
    s.pop(("k", 5))
    s.put(("again", 5), vals[5] * 2)                # the freed slot reused
    assert s.end == end and torch.equal(s.get(("again", 5)), vals[5] * 2)
    s.reserve("t", (50, 30), torch.float32)
    for r0 in range(0, 50, 20):
        s.write_rows("t", r0, torch.full((min(20, 50 - r0), 30),
                                         float(r0)))
    assert torch.equal(s.slice("t", 40, 42), torch.full((2, 30), 40.0))
    with pytest.raises(KeyError):
        s.get("nothing")
    s.close()
    assert set(os.listdir(tmp_path)) == before


def test_spill_folder_avoids_the_inputs(tmp_path):
    inp = tmp_path / "A"
    inp.mkdir()
    assert rt.spill_folder(str(tmp_path / "out"), [str(inp)]) == \
        str(tmp_path)
    assert rt.spill_folder(str(inp / "out"), [str(inp)]) != str(inp)
    with pytest.raises(BicoError, match="inside the input"):
        rt.spill_folder(None, [str(inp)], given=str(inp))


# ---- results equal the in-memory route's ----

def test_fit_equals_in_memory_bit_for_bit(pair):
    """transfer_model on folders and on the loaded modules, the same
    batches: every tensor equal (the fit's, and the norms and tied
    embedding BiCo carries), at a given alpha and with the held-out
    choice; the report says the same."""
    cal = cal_of(pair, holdout=0)
    src, srt, tgt = models(pair)
    paths = [str(pair / f) for f in ("A", "A_full", "B")]
    for kw in (dict(alpha=0.8), dict(ridge=[0.01, 0.1])):
        r_mem, r_str = [], []
        want = bt.transfer_model(src, srt, tgt, cal.batches, method="fit",
                                 options=bt.FitOptions(**kw),
                                 loss_fn=bl.next_token_loss, report=r_mem)
        got = bl.transfer_model(*paths, cal.batches, method="fit",
                                options=bt.FitOptions(**kw), report=r_str,
                                stream=bl.Streaming(memory_budget=1 << 14))
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (kw, k)
        assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
        moved = [k for k in want if not torch.equal(
            want[k], tgt.state_dict()[k])]
        assert "model.norm.weight" in moved and \
            "model.embed_tokens.weight" in moved
        fit = lambda r: [(e["name"], e["rows"], e["rank"]) for e in r
                         if e.get("handling") == "fit"]
        assert fit(r_str) == fit(r_mem) and len(fit(r_mem)) == 21
        # the choice: the same; the losses to rounding (the in-memory
        # route scales in float32, the streamed one in double)
        c_str = [e for e in r_str if "alpha" in e]
        c_mem = [e for e in r_mem if "alpha" in e]
        assert len(c_str) == len(c_mem) == ("ridge" in kw)
        for a, b in zip(c_str, c_mem):
            assert a.keys() == b.keys()
            assert (a["alpha"], a.get("ridge")) == (b["alpha"], b.get("ridge"))
            for g in b["losses"]:
                assert abs(a["losses"][g] - b["losses"][g]) < 1e-6


def test_transfer_model_output_follows_the_folder_rules(pair, tmp_path):
    """transfer_model(folders, output=): the folder written holds the
    state dict the call returns without output= (the file's dtype); an
    output inside an input folder is refused before anything is read,
    and nothing appears there."""
    cal = cal_of(pair, holdout=0)
    paths = [str(pair / f) for f in ("A", "A_full", "B")]
    want = bl.transfer_model(*paths, cal.batches, method="fit",
                             options=bt.FitOptions(alpha=0.8))
    out = tmp_path / "B_ft"
    got = bl.transfer_model(*paths, cal.batches, method="fit",
                            options=bt.FitOptions(alpha=0.8),
                            output=str(out) + "/")
    assert got["output"] == str(out) + "/" and got["alpha"] == 0.8
    files = st.read(str(out) + "/")
    assert set(files) == set(want) - {"lm_head.weight"}
    with st.open(fam._weights_path(str(pair / "B"))) as f:
        dts = {k: f.info(k)[0] for k in f.keys()}
    old = st.read(str(pair / "B") + "/")
    for k, v in files.items():
        # rounded once to the file's dtype (the state dict: the compute
        # dtype): equal to a rounding of the file's dtype
        w = want[k].float().numpy()
        np.testing.assert_allclose(v, w, rtol=2.0 ** -7 if dts[k] == "BF16"
                                   else 1e-6, atol=0, err_msg=k)
        assert not np.array_equal(v, old[k]) or np.array_equal(w, v), k
    inside = pair / "B" / "sub"
    with pytest.raises(BicoError) as e:
        bl.transfer_model(*paths, cal.batches, method="fit",
                          options=bt.FitOptions(alpha=0.8),
                          output=str(inside) + "/")
    assert "B" in e.value.message and not inside.exists()


def test_transfer_model_spill_dir_follows_the_commands_rule(pair, tmp_path):
    """spill_dir= on folders is checked as the command's --spill-dir: a
    folder inside an input, a missing one and a file are refused before
    anything is read, naming the option and the reason; nothing is left
    in the input."""
    cal = cal_of(pair, holdout=0)
    paths = [str(pair / f) for f in ("A", "A_full", "B")]
    sub = pair / "B" / "spill"
    sub.mkdir()
    try:
        a_file = tmp_path / "a_file"
        a_file.write_text("x")
        for bad, why in ((sub, "inside the input folder"),
                         (tmp_path / "none", "no such folder"),
                         (a_file, "not a folder")):
            before = sorted(os.listdir(sub))
            with pytest.raises(BicoError) as e:
                bl.transfer_model(*paths, cal.batches, method="fit",
                                  options=bt.FitOptions(alpha=0.8),
                                  stream=bl.Streaming(spill_dir=str(bad)))
            assert "spill_dir" in e.value.message and \
                why in e.value.message, e.value.message
            assert sorted(os.listdir(sub)) == before
    finally:
        sub.rmdir()


def test_command_outputs_equal_the_in_memory_route(pair, tmp_path):
    """python3 -m bico.llm streamed and --in-memory: the model folders
    are byte for byte the same; the adapters hold the same tensors."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for args in (["--output", "OUT/", "--ridge", "0.01,0.1"],
                 ["--output-lora", "OUT/", "--rank", "4", "--alpha", "1.5",
                  "--modules-to-save",
                  "norm,input_layernorm,post_attention_layernorm,"
                  "embed_tokens"]):
        outs = {}
        for mode in ("stream", "mem"):
            dest = tmp_path / ("%s-%s" % (mode, args[0][2:]))
            cmd = PY + ["--source", "A/", "--source-tuned", "A_full/",
                        "--target", "B/", "--text", "task.txt", "--window",
                        "32", "--threads", "1"] + \
                [str(dest) + "/" if a == "OUT/" else a for a in args] + \
                (["--in-memory"] if mode == "mem" else [])
            r = subprocess.run(cmd, cwd=str(pair), env=env,
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            outs[mode] = (dest, r.stdout)
        (ds, out_s), (dm, out_m) = outs["stream"], outs["mem"]
        assert out_s.splitlines()[0] == out_m.splitlines()[0]  # chosen: ...
        assert sorted(os.listdir(ds)) == sorted(os.listdir(dm))
        if args[0] == "--output":
            for n in os.listdir(dm):
                if not n.endswith(".safetensors"):
                    assert open(ds / n, "rb").read() == \
                        open(dm / n, "rb").read()
                    continue
                a, b = st.read(str(ds / n)), st.read(str(dm / n))
                assert list(a) == list(b)
                for k in b:
                    assert a[k].dtype == b[k].dtype and \
                        a[k].tobytes() == b[k].tobytes(), k
                # the same metadata; the held-out loss recorded is the
                # streamed update's at the compute dtype, the in-memory
                # route's that of the output as written: rounding apart
                ma, mb = _metadata(ds / n), _metadata(dm / n)
                la, lb = (float(m.pop("bico_heldout_loss")) for m in (ma, mb))
                assert ma == mb and abs(la - lb) < 1e-3 * lb
        else:
            a = st.read(str(ds / "adapter_model.safetensors"))
            b = st.read(str(dm / "adapter_model.safetensors"))
            assert list(a) == list(b)
            for k in b:
                np.testing.assert_allclose(a[k], b[k], rtol=0,
                                           atol=1e-2 * np.abs(b[k]).max())
            assert json.load(open(ds / "adapter_config.json")) == \
                json.load(open(dm / "adapter_config.json"))


def _metadata(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))["__metadata__"]


def _head_io(model, batches):
    """The rows of lm_head's input and of its output over batches
    (float64), by a forward hook on the whole model."""
    xs, ys = [], []
    hook = model.lm_head.register_forward_hook(
        lambda m, i, o: (xs.append(i[0].detach()), ys.append(o.detach())))
    try:
        with torch.no_grad():
            for x, _ in batches:
                model(x)
    finally:
        hook.remove()
    rows = lambda t: torch.cat([v.reshape(-1, v.shape[-1]) for v in t])
    return rows(xs).double(), rows(ys).double()


def test_untied_head_is_fitted_by_token_id(untied):
    """Llama folders with untied heads: the blocks' fitted layers equal
    the in-memory fit's bit for bit, the head the in-memory fit's to
    float rounding (both keep its outputs by token id: the model's
    get_output_embeddings()); the head is fitted after them, its
    output change kept by token id (the closed-form ridge solution with
    the identity output map, computed here from whole models: X' the
    head's inputs on the target with the streamed blocks, X_B on the
    target, D the source pair's logit change); fitted in pieces of
    vocabulary rows it is the one-piece fit; its report entry says so and
    BiCo does not also carry it."""
    d, batches = untied
    src, srt, tgt = (bl.load_model(d / f, dtype=torch.float32)
                     for f in ("A", "A_ft", "B"))
    want = bt.transfer_model(src, srt, tgt, batches, method="fit",
                             options=bt.FitOptions(alpha=1.0),
                             loss_fn=bl.next_token_loss)
    rep = []
    got = bl.transfer_model(str(d / "A"), str(d / "A_ft"), str(d / "B"),
                            batches, method="fit",
                            options=bt.FitOptions(alpha=1.0), report=rep)
    for k in want:
        if k != "lm_head.weight":
            assert torch.equal(got[k], want[k]), k
    w = tgt.lm_head.weight.detach().double()
    assert torch.allclose(got["lm_head.weight"], want["lm_head.weight"],
                          rtol=0, atol=1e-6 * float(w.abs().max()))
    work = bl.load_model(d / "B", dtype=torch.float32)
    work.load_state_dict(dict(got, **{"lm_head.weight": tgt.lm_head.weight}))
    x1, _ = _head_io(work, batches)
    x0, _ = _head_io(tgt, batches)
    d_out = _head_io(srt, batches)[1] - _head_io(src, batches)[1]
    lam = 1e-2 * torch.trace(x1.T @ x1) / x1.shape[1]
    dw = torch.linalg.solve(x1.T @ x1 + lam * torch.eye(x1.shape[1],
                                                        dtype=torch.float64),
                            x1.T @ (x0 @ w.T + d_out - x1 @ w.T)).T
    ref = w + dw
    err = (got["lm_head.weight"].double() - ref).abs().max()
    assert err < 1e-5 * ref.abs().max(), err
    assert dw.norm() > 0.1 * w.norm()   # the head moved: not a no-op
    head = [e for e in rep if e["name"] in ("lm_head", "lm_head.weight")]
    assert len(head) == 1 and head[0]["handling"] == "fit" and \
        head[0]["outputs"] == "by id" and head[0]["name"] == "lm_head"
    with StreamedFit(str(d / "A"), str(d / "A_ft"), str(d / "B"),
                     batches) as sf:
        sf.run.logits_budget = 4 * 24 * 10   # pieces of a few rows
        res = sf.fit(1e-2)
        key = res.new["lm_head.weight"]
        assert torch.allclose(sf.run.store.get(key), got["lm_head.weight"],
                              rtol=0, atol=1e-6)


def test_untied_head_scores_as_the_loaded_model(untied):
    """The held-out score of a fit with a fitted untied head, for every
    candidate alpha, is the next-token loss of the target with that state
    dict loaded whole (before, the score read the file's head and ignored
    the fitted one)."""
    d, batches = untied
    cal, held = batches[:-2], batches[-2:]
    with StreamedFit(str(d / "A"), str(d / "A_ft"), str(d / "B"), cal,
                     held) as sf:
        res = sf.fit(1e-2)
        per = sf.score(res, [0.0, 0.5, 1.0])
        from bico.llm.stream.route import _state_dict
        states = {a: _state_dict(res, a) for a in per}
    model = bl.load_model(d / "B", dtype=torch.float32)
    for a, scores in per.items():
        model.load_state_dict(states[a])
        with torch.no_grad():
            want = [float(bl.next_token_loss(model(x), y)) for x, y in held]
        assert np.allclose([v for v, _ in scores], want, rtol=1e-5), a
    assert per[1.0][0][0] != per[0.0][0][0]


def test_threads_reach_the_library(pair, monkeypatch):
    """threads=None is PyTorch's count for the library's contexts (the
    fit's solves and the statistics): before, the fit's context ran on
    one thread whatever PyTorch used."""
    import bico.fit
    seen = []
    orig = bico.fit.run

    def run(*a, **kw):
        seen.append(kw["ctx"].threads)
        return orig(*a, **kw)
    monkeypatch.setattr(bico.fit, "run", run)
    cal = cal_of(pair, holdout=0)
    src, srt, tgt = models(pair)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        bt.transfer_model(src, srt, tgt, cal.batches[:2], method="fit",
                          options=bt.FitOptions(alpha=1.0),
                          loss_fn=bl.next_token_loss)
        with StreamedFit(*(str(pair / f) for f in ("A", "A_full", "B")),
                         cal.batches[:2], threads=3) as sf:
            assert sf.run.ctx.threads == 3 and torch.get_num_threads() == 3
            sf.fit(0.01)
    finally:
        torch.set_num_threads(old)
    assert seen == [2, 3]


def test_bad_inputs_are_refused(pair, untied):
    cal = cal_of(pair, holdout=0)
    src = bl.load_model(pair / "A")
    with pytest.raises(BicoError, match="model folders but target"):
        bl.transfer_model(str(pair / "A"), str(pair / "A_full"), src,
                          cal.batches, method="fit")
    with pytest.raises(BicoError, match="bico.llm.transfer_model takes "
                       "model folders"):
        bt.transfer_model(*(str(pair / f) for f in ("A", "A_full", "B")),
                          cal.batches, method="fit")
    with pytest.raises(BicoError, match="output= is the streamed fit's"):
        bl.transfer_model(src, src, src, cal.batches, method="fit",
                          output=str(pair / "out"))
    with pytest.raises(BicoError, match="next-token loss"):
        bl.transfer_model(*(str(pair / f) for f in ("A", "A_full", "B")),
                          cal.batches, method="fit",
                          loss_fn=lambda o, y: o.sum())
    with pytest.raises(BicoError, match="tuned source must have"):
        StreamedFit(str(pair / "A"), str(untied[0] / "A"), str(pair / "B"),
                    cal.batches)
    with pytest.raises(BicoError, match="batches of token ids"):
        StreamedFit(*(str(pair / f) for f in ("A", "A_full", "B")),
                    [torch.zeros(2, 3)])


# ---- a kill at any moment ----

def _left_tmp(base):
    """The command's temporary folders (bico-llm-PID-*) left in `base`,
    the runs' private $TMPDIR: every run there has ended, so any such
    folder is a leftover.  (A private folder, not /tmp: another test
    running beside this one may leave a killed run's folder there.)"""
    return sorted(n for n in os.listdir(base) if n.startswith("bico-llm-"))


def _spill_like(folder):
    return sorted(n for n in os.listdir(folder)
                  if "bico-spill" in n or "bico-tmp" in n)


@pytest.mark.parametrize("point,sig", [("fit:5", "TERM"), ("write:7", "TERM"),
                                       ("write:7", "KILL")])
def test_killed_run_leaves_the_old_output_and_no_spill(pair, tmp_path, point,
                                                       sig):
    """A run stopped by a signal in the fit or while writing: the output
    folder is the old one, untouched; SIGTERM leaves no temporary at all,
    SIGKILL only the library's hidden temporary folder, which the next
    run removes; the spill file never had a name.  The next run
    completes."""
    out = tmp_path / "B_ft"
    out.mkdir()
    (out / "old.txt").write_text("old")
    spill = tmp_path / "spill"
    spill.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp),
               BICO_STREAM_TEST_KILL="%s:%s" % (point, sig))
    cmd = PY + ["--source", "A/", "--source-tuned", "A_full/", "--target",
                "B/", "--text", "task.txt", "--window", "32", "--output",
                str(out) + "/", "--spill-dir", str(spill), "--memory-budget",
                "0.01", "--alpha", "1"]
    r = subprocess.run(cmd, cwd=str(pair), env=env, capture_output=True,
                       text=True, timeout=300)
    # SIGTERM ends the command as an exception would (exit 128 + signal)
    assert r.returncode == (128 + signal.SIGTERM if sig == "TERM" else
                            -signal.SIGKILL), r.stderr[-2000:]
    assert os.listdir(out) == ["old.txt"] and \
        (out / "old.txt").read_text() == "old"
    # the spill store's file never had a name; a SIGKILL leaves the run's
    # scratch folder (in --spill-dir), which the next run removes
    assert os.listdir(spill) == [] if sig == "TERM" else \
        all(n.startswith("bico-llm-") for n in os.listdir(spill))
    left = _spill_like(tmp_path)
    assert left == [] if sig == "TERM" else \
        all(n.startswith(".B_ft.bico-tmp.") for n in left)
    if sig == "TERM":
        assert _left_tmp(tmp) == []
    env.pop("BICO_STREAM_TEST_KILL")
    r = subprocess.run(cmd, cwd=str(pair), env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.listdir(spill) == []      # the killed run's scratch removed
    assert "model.safetensors.index.json" in os.listdir(out)
    # the folder commit carries the old folder's other files over
    assert (out / "old.txt").read_text() == "old"
    assert _spill_like(tmp_path) == [] and os.listdir(spill) == []
    assert _left_tmp(tmp) == []


# ---- a target shard rewritten in place while the run reads it ----

_REWRITE = r"""
import os, runpy, sys
import bico.llm.stream.fit as sf, bico.llm.stream.out as so
point, k, shard = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def hook(p, i, _orig=so.test_point):
    if p == point and i + 1 == k:
        fd = os.open(shard, os.O_WRONLY)   # in place: size and header kept
        os.pwrite(fd, b"\x80\x3f", os.fstat(fd).st_size - 2)
        os.close(fd)
    _orig(p, i)
sf.test_point = so.test_point = hook
sys.argv = ["bico.llm"] + sys.argv[4:]
runpy.run_module("bico.llm", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("point", ["fit:2", "write:3"])
def test_a_target_shard_rewritten_during_the_run_fails_it(pair, tmp_path,
                                                          point):
    """issue 45: a shard of the target rewritten in place while the
    streamed fit reads it (during the fit, or while the output is
    written) gave an output of two versions of B, exit 0.  The run checks
    every weight file it reads before the commit: exit 1, one line naming
    the shard, the old output folder as it was, no temporary left."""
    import shutil
    for f in ("A", "A_full", "B"):
        shutil.copytree(str(pair / f), str(tmp_path / f))
    shutil.copy(str(pair / "task.txt"), str(tmp_path / "task.txt"))
    shards = sorted(n for n in os.listdir(tmp_path / "B")
                    if n.startswith("model-"))
    shard = tmp_path / "B" / shards[-1]
    for n in shards:      # written long ago: a rewrite moves the time
        os.utime(str(tmp_path / "B" / n), (1e9, 1e9))
    out = tmp_path / "B_ft"
    out.mkdir()
    (out / "old.txt").write_text("old")
    env = dict(os.environ, OMP_NUM_THREADS="1", BICO_BLIS_ARCH="auto")
    env.pop("BICO_STREAM_TEST_KILL", None)
    p, k = point.split(":")
    r = subprocess.run(
        [sys.executable, "-c", _REWRITE, p, k, str(shard), "--method", "fit",
         "--source", "A/", "--source-tuned", "A_full/", "--target", "B/",
         "--text", "task.txt", "--window", "32", "--windows", "8",
         "--output", str(out) + "/", "--alpha", "1", "--quiet"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True,
        timeout=300)
    err = [x for x in r.stderr.splitlines()
           if x.strip() and ": warning: " not in x]
    assert r.returncode == 1, r.stderr[-2000:]
    assert len(err) == 1, r.stderr
    assert shards[-1] in err[0] and "changed while it was being read" \
        in err[0], err
    assert os.listdir(out) == ["old.txt"] and \
        (out / "old.txt").read_text() == "old"
    assert _spill_like(tmp_path) == []
