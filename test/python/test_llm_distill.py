"""python3 -m bico.llm's distillation route end to end, on the folders of
test/e2e/llm_pair.py (widths 16 -> 32, depths 2 -> 3, sharded BF16, tied
heads, a byte-level tokenizer.json, a PEFT adapter of the source and its
task text): the adapter it trains has PEFT's names, float32 factors and
config, loads and merges with libbico, and lowers the next-token loss on
held-out task text (eval.txt, never seen by the command) below the
untouched target's; --method auto keeps the route with the least
held-out loss; a dense run writes a model folder; the teacher spills to a
temporary folder that is gone afterwards; a harmful teacher leaves the
target unchanged."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import bico.lora as bl
import bico.safetensors as st
import bico.llm as llm
from bico._status import BicoError

HERE = os.path.dirname(os.path.abspath(__file__))
import llm_pair  # noqa: E402

torch.set_num_threads(1)
BICO = os.path.join(os.environ.get("BICO_BUILD", "build"), "bin", "bico")
LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
           "v_proj"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    info = llm_pair.make(str(d))
    assert info["loss_ft"] < info["loss_a"] - 0.5
    return d, info


def command(d, *args, env=None, ok=True):
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    r = subprocess.run([sys.executable, "-m", "bico.llm"] + list(args),
                       cwd=str(d), env=e, capture_output=True, text=True,
                       timeout=600)
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def eval_loss(model, d):
    cal = llm.text_batches(str(d / "eval.txt"), 32, holdout=0,
                          tokenizer=str(d / "B"))
    return llm.lm_loss(model, cal.batches)


def merged_loss(d, adapter):
    """B with the adapter merged by libbico (bico transfer), scored."""
    out = d / ("%s.safetensors" % adapter)
    subprocess.run([BICO, "transfer", "--method", "naive", "--source-base",
                    "B", "--target-base", "B", "--lora", adapter,
                    "--output-lora", "carried-" + adapter,
                    "--merge-into-base", "--output", str(out), "--quiet"],
                   cwd=str(d), check=True)
    tgt = llm.load_model(d / "B", dtype=torch.float32)
    sd = tgt.state_dict()
    sd.update({k: torch.from_numpy(v) for k, v in
               st.read(str(out), dtype=np.float32).items()})
    tgt.load_state_dict(sd)
    return eval_loss(tgt, d)


def held_out(stderr):
    """{route: held-out loss} from the line the command prints."""
    line = [x for x in stderr.splitlines()
            if x.startswith("held-out next-token loss on")][-1]
    return {k: float(v) for k, v in (p.split() for p in
                                     line.split(": ", 1)[1].split("; "))}


def test_trained_adapter_end_to_end(pair):
    d, info = pair
    r = command(d, "--source", "A/", "--lora", "A_adapter/", "--target",
                "B/", "--text", "task.txt", "--output-lora", "B_distilled/",
                "--rank", "4", "--window", "32", "--method", "distill",
                "--steps", "120")
    # every phase says its progress; the choice is printed
    for phase in ("teacher (the three models a block at a time)",
                  "distill steps:",
                  "distill: kept step"):
        assert phase in r.stderr, r.stderr
    assert "chosen: distill" in r.stdout, r.stdout
    ad = d / "B_distilled"
    cfg = json.load(open(ad / "adapter_config.json"))
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and \
        cfg["lora_alpha"] == 4.0 and cfg["target_modules"] == LINEARS
    assert cfg["base_model_name_or_path"] == os.path.realpath(d / "B") or \
        cfg["base_model_name_or_path"] == os.path.abspath(d / "B")
    note = json.load(open(ad / "bico_adapter.json"))
    assert note["bico_transfer_method"] == "distill"
    # PEFT's names, float32 factors of rank 4 on every linear but the head
    tgt = llm.load_model(d / "B")
    f = st.open(str(ad / "adapter_model.safetensors"))
    lin = [n for n, m in tgt.named_modules()
           if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for n in lin:
        w = tgt.get_submodule(n).weight
        assert f.info("base_model.model.%s.lora_A.weight" % n) == \
            ("F32", (4, w.shape[1]))
        assert f.info("base_model.model.%s.lora_B.weight" % n) == \
            ("F32", (w.shape[0], 4))
    assert sorted(bl.Adapter.open(str(ad)).modules()) == sorted(lin)
    # merged by libbico: the held-out task loss well below zero-shot
    zero = eval_loss(llm.load_model(d / "B", dtype=torch.float32), d)
    got = merged_loss(d, "B_distilled")
    assert got < zero - 0.3 * (zero - info["loss_ft"]), (got, zero)
    losses = held_out(r.stderr)
    assert losses["distill"] < losses["target"]


def test_auto_keeps_the_route_with_the_least_held_out_loss(pair):
    d, _ = pair
    r = command(d, "--source", "A", "--source-tuned", "A_ft", "--target",
                "B", "--text", "task.txt", "--output-lora", "B_auto",
                "--rank", "4", "--window", "32", "--steps", "60")
    losses = held_out(r.stderr)
    assert set(losses) == {"target", "fit", "distill"}
    best = min(("fit", "distill"), key=lambda k: losses[k])
    assert ("chosen: %s among fit, distill" % best) in r.stdout, r.stdout
    note = json.load(open(d / "B_auto" / "bico_adapter.json"))
    assert note["bico_transfer_method"] == best


def test_dense_distillation_writes_a_model_folder(pair):
    d, info = pair
    r = command(d, "--source", "A", "--source-tuned", "A_ft", "--target",
                "B", "--text", "task.txt", "--output", "B_dense",
                "--window", "32", "--method", "distill", "--steps", "80")
    assert "every weight of the target" in r.stderr
    new = llm.load_model(d / "B_dense")
    assert new.lm_head.weight is new.model.embed_tokens.weight
    assert all(v.dtype == torch.bfloat16 for v in new.state_dict().values())
    zero = eval_loss(llm.load_model(d / "B", dtype=torch.float32), d)
    got = eval_loss(new.float(), d)
    assert got < zero - 0.3 * (zero - info["loss_ft"]), (got, zero)


def test_the_teacher_spills_and_leaves_nothing(pair, tmp_path):
    d, _ = pair
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = command(d, "--source", "A", "--source-tuned", "A_ft", "--target",
                "B", "--text", "task.txt", "--output-lora",
                str(tmp_path / "ad"), "--window", "32", "--method",
                "distill", "--steps", "20", "--teacher-memory", "0",
                "--teacher-k", "16", env={"TMPDIR": str(tmp)})
    line = [x for x in r.stderr.splitlines() if x.startswith("teacher: ")]
    assert line and "0.0 MB in memory" in line[0] and \
        "top 16 of 256 outputs" in line[0], r.stderr
    assert float(line[0].split(", ")[2].split()[0]) > 0   # MB spilled
    assert os.listdir(tmp) == [], os.listdir(tmp)


def test_a_harmful_teacher_leaves_the_target_unchanged(pair, tmp_path):
    """A "fine-tune" that is noise, carried to a target that already does
    the task (A_ft itself): the teacher misleads, no step beats the
    untouched target clearly on the held-out windows, and the adapter
    written is PEFT's no-op (zero factors)."""
    d, _ = pair
    sd = llm.load_model(d / "A").state_dict()
    g = torch.Generator().manual_seed(0)
    noisy = {k: (v.float() + 2.0 * torch.randn(v.shape, generator=g))
             for k, v in sd.items() if k != "lm_head.weight"}
    st.write(str(tmp_path / "A_noise") + "/", noisy, like=str(d / "A"))
    r = command(d, "--source", "A", "--source-tuned",
                str(tmp_path / "A_noise"), "--target", "A_ft", "--text",
                "task.txt", "--output-lora", str(tmp_path / "ad"),
                "--window", "32", "--method", "distill", "--steps", "40",
                "--text-weight", "0")
    assert "chosen: target" in r.stdout and "unchanged" in r.stdout, \
        r.stdout + r.stderr
    f = st.open(str(tmp_path / "ad" / "adapter_model.safetensors"))
    for k in f.keys():
        if k.endswith("lora_B.weight"):
            assert not np.any(f.get(k, np.float32))


def test_route_options_are_checked_before_anything_runs(pair, tmp_path):
    d, _ = pair
    base = ["--source", "A", "--source-tuned", "A_ft", "--target", "B",
            "--text", "task.txt"]
    for extra, msg in (
            (["--output-lora", "OUT", "--trainable", "dense"], "--trainable"),
            (["--output", "OUT", "--init", "warm"], "--init warm"),
            (["--output-lora", "OUT", "--method", "fit", "--init", "warm"],
             "--init"),
            (["--output-lora", "OUT", "--text-weight", "0",
              "--teacher-weight", "0"], "both 0"),
            (["--output-lora", "OUT", "--teacher-k", "0"], "--teacher-k"),
            (["--output-lora", "OUT", "--steps", "-3"], "--steps"),
            (["--output-lora", "OUT", "--lr", "nan"], "--lr"),
            (["--output-lora", "OUT", "--device", "cuda:7"], "--device")):
        if extra[-2:] == ["--device", "cuda:7"] and torch.cuda.is_available():
            continue
        r = command(d, *(base + [a.replace("OUT", str(tmp_path / "x"))
                                 for a in extra]), ok=False)
        assert r.returncode == 2 and msg in r.stderr and \
            len(r.stderr.strip().splitlines()) == 1, (extra, r.stderr)
        assert not os.path.exists(tmp_path / "x")


def test_the_source_pair_is_freed_before_the_training(pair):
    """run(release=...) drops every reference to the source pair once the
    teacher is computed: when the training starts, neither model is
    alive (weak references, after a collection)."""
    import gc
    import weakref
    from bico.llm import distill as ld
    d, _ = pair
    models = {"source": llm.load_model(d / "A", dtype=torch.float32),
              "tuned": llm.load_model(d / "A_ft", dtype=torch.float32)}
    refs = [weakref.ref(m) for m in models.values()]
    tgt = llm.load_model(d / "B", dtype=torch.float32)
    cal = llm.text_batches(str(d / "task.txt"), 32, n=24,
                          tokenizer=str(d / "B"))
    alive = []

    def log(msg):
        if msg.startswith("distill: LoRA rank"):
            gc.collect()
            alive.append([r() is not None for r in refs])
    from bico.torch.distill import Training
    ld.run(models["source"], models["tuned"], tgt, cal, log,
           student=ld.Student(rank=2),
           training=Training(steps=2, text_weight=ld.TEXT_WEIGHT),
           release=models.clear)
    assert alive == [[False, False]]


def test_the_command_holds_only_the_target_while_it_trains(pair, tmp_path,
                                                           monkeypatch):
    """Through python3 -m bico.llm (in process): when the training starts,
    no decoder but the target is alive (the source pair was handed over
    in a dict that run() empties: the command's own call must not keep it,
    a 0.5B pair is 2 GB in bf16)."""
    import gc
    import bico.llm
    from bico.llm import distill as ld
    d, _ = pair
    seen = []
    train = ld._train

    def lms():
        gc.collect()
        return [o for o in gc.get_objects()
                if isinstance(o, torch.nn.Module) and hasattr(o, "lm_head")]
    # decoders other tests of this process keep alive are not the run's
    before = lms()

    def spy(target, *args, **kw):
        seen.append([o is target for o in lms()
                     if not any(o is b for b in before)])
        return train(target, *args, **kw)
    monkeypatch.setattr(ld, "_train", spy)
    old = os.getcwd()
    os.chdir(str(d))
    try:
        status = bico.llm.main([
            "--source", "A", "--source-tuned", "A_ft", "--target", "B",
            "--text", "task.txt", "--output-lora", str(tmp_path / "out"),
            "--method", "distill", "--steps", "2", "--windows", "24",
            "--window", "32", "--rank", "2", "--quiet"])
    finally:
        os.chdir(old)
    assert status == 0
    assert seen == [[True]]


def test_the_teacher_from_the_folders_is_the_in_memory_teacher(pair):
    """bico.llm.stream.teacher (each model run from its folder a block at
    a time, the boundary states spilled to disk) gives the entries
    build_teacher computes from the three whole models, bit for bit, at
    every k (all outputs, top-k with the rest's mass)."""
    from bico.llm.stream import teacher as stream_teacher
    from bico.torch import distill as D
    d, _ = pair
    cal = llm.text_batches(str(d / "task.txt"), 32, n=24,
                          tokenizer=str(d / "B"), batch_size=5)
    xs = [x for x, _ in cal.batches]
    folders = [str(d / n) for n in ("A", "A_ft", "B")]
    models = [llm.load_model(f, dtype=torch.float32) for f in folders]
    for k in (None, 7):
        ref = D.build_teacher(*models, xs, None, k=k)
        got = stream_teacher.build(*folders, xs, dtype=torch.float32, k=k,
                                   store_budget=0, chunk=13)
        assert len(got) == len(ref) == len(xs)
        for i in range(len(xs)):
            e1, e2 = ref.get(i), got.get(i)
            e1 = e1 if isinstance(e1, tuple) else (e1,)
            e2 = e2 if isinstance(e2, tuple) else (e2,)
            assert len(e1) == len(e2) == (1 if k is None else 3)
            for t1, t2 in zip(e1, e2):
                assert t1.shape == t2.shape and torch.equal(t1, t2)
        ref.close()
        got.close()


def test_the_teacher_refuses_two_vocabularies(tmp_path):
    """A source whose head has another vocabulary than the target's is
    refused before any block runs, naming the folders and their sizes."""
    import llama
    from bico.llm.stream import teacher as stream_teacher
    g = torch.Generator().manual_seed(3)
    for name, vocab in (("A", 64), ("A_ft", 64), ("B", 60)):
        cfg = llama.default_config(vocab_size=vocab, hidden_size=16,
                                   intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4,
                                   num_key_value_heads=2,
                                   tie_word_embeddings=False)
        llama.write_folder(str(tmp_path / name), cfg,
                           llama.random_state(cfg, g))
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(BicoError) as e:
        stream_teacher.build(*(str(tmp_path / n) for n in ("A", "A_ft", "B")),
                             [x])
    msg = str(e.value)
    assert "one vocabulary" in msg and "has 60 outputs" in msg and \
        str(tmp_path / "B") in msg, msg


def test_distill_from_the_folders_equals_the_in_memory_run(pair, tmp_path):
    """python3 -m bico.llm --method distill computes its teacher from the
    folders and loads the target alone; --in-memory holds the three
    models: the written adapters are the same bytes (the teacher's
    entries are equal, the training is seeded)."""
    d, _ = pair
    outs = []
    for extra in ((), ("--in-memory",)):
        out = tmp_path / ("out%d" % len(outs))
        r = command(d, "--source", "A/", "--source-tuned", "A_ft/",
                    "--target", "B/", "--text", "task.txt", "--output-lora",
                    str(out), "--rank", "2", "--window", "32", "--windows",
                    "24", "--method", "distill", "--steps", "6", *extra)
        want = "teacher (the three models a block at a time)" if not extra \
            else "teacher (three models per window)"
        assert want in r.stderr, r.stderr
        outs.append(out)
    f0 = st.open(str(outs[0] / "adapter_model.safetensors"))
    f1 = st.open(str(outs[1] / "adapter_model.safetensors"))
    assert sorted(f0.keys()) == sorted(f1.keys()) and len(f0.keys()) > 0
    moved = 0
    for k in f0.keys():
        a, b = f0.get(k), f1.get(k)
        assert np.array_equal(a, b), k
        moved += int("lora_B" in k and np.abs(a).max() > 0)
    assert moved > 0          # the factors trained (B starts at zero)


def test_the_heap_is_given_back_on_this_c_library():
    """bico._heap on glibc (Debian's C library): malloc_trim and the trim
    threshold are found and take effect.  In a child process that sets
    the threshold, 1 GiB of 1 MiB tensors is allocated and every other
    one freed: half of it leaves the resident set.  (glibc's default,
    once a freed large block has raised its mmap threshold, serves such
    tensors from the heap and keeps the holes: measured here, the whole
    1 GiB stayed resident.)"""
    from bico import _heap
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        # AddressSanitizer's allocator replaces glibc's: its mallopt does
        # nothing and it keeps freed memory in quarantine by design
        pytest.skip("the C library's allocator is AddressSanitizer's")
    assert _heap.trim() is True
    code = """
import torch
from bico import _heap
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024.0
assert _heap.give_back_on_free()
big = torch.ones(4 << 20)
del big
r0 = rss()
keep = [torch.ones(256 * 1024) for _ in range(1024)]
r1 = rss()
keep = keep[1::2]
print(r1 - r0, rss() - r0)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, env=dict(os.environ), timeout=300)
    assert r.returncode == 0, r.stderr
    grown, left = (float(v) for v in r.stdout.split())
    assert grown > 900, grown                 # the tensors were resident
    assert left < grown / 2 + 64, (grown, left)   # the freed half is not


def test_auto_from_the_folders_equals_the_in_memory_run(pair, tmp_path):
    """--method auto at its defaults streams: the fit a block at a time,
    the teacher one model at a time, the target alone loaded to train.
    The in-memory run (--in-memory) makes the same choice on the same
    held-out losses and writes the same adapter (the fit's equal to float
    rounding, the distillation's bit for bit)."""
    d, _ = pair
    outs, lines = [], []
    for extra in ((), ("--in-memory",)):
        out = tmp_path / ("auto%d" % len(outs))
        r = command(d, "--source", "A/", "--source-tuned", "A_ft/",
                    "--target", "B/", "--text", "task.txt", "--output-lora",
                    str(out), "--rank", "2", "--window", "32", "--windows",
                    "24", "--steps", "30", *extra)
        streamed = "teacher (the three models a block at a time)" in r.stderr
        assert streamed == (not extra), r.stderr
        chosen = [ln for ln in r.stdout.splitlines()
                  if ln.startswith("chosen:") and " among " in ln]
        assert len(chosen) == 1, r.stdout
        lines.append((chosen[0], held_out(r.stderr)))
        outs.append(out)
    (c0, h0), (c1, h1) = lines
    assert c0 == c1 and sorted(h0) == sorted(h1) == ["distill", "fit",
                                                     "target"], lines
    for k in h0:
        assert abs(h0[k] - h1[k]) < 1e-3, (k, h0, h1)
    f0 = st.open(str(outs[0] / "adapter_model.safetensors"))
    f1 = st.open(str(outs[1] / "adapter_model.safetensors"))
    assert sorted(f0.keys()) == sorted(f1.keys())
    for k in f0.keys():
        a, b = f0.get(k), f1.get(k)
        assert np.allclose(a, b, rtol=1e-4, atol=1e-6), k


def test_a_source_weight_that_is_not_finite_stops_the_distillation(
        pair, tmp_path):
    """NaN in a weight of the source (issue 45): the teacher's logits
    z_B + z_A_ft - z_A are NaN, and the distillation trained on them and
    exited 0.  Now the teacher refuses them naming the model, exit 1, and
    nothing is written."""
    import glob
    import shutil
    d, _ = pair
    nan = tmp_path / "A_nan"
    shutil.copytree(d / "A", nan)
    for shard in sorted(glob.glob(str(nan / "*.safetensors"))):
        with st.open(shard) as f:
            names = list(f.keys())
            dtypes = {k: f.info(k)[0] for k in names}
            tensors = {k: f.get(k, np.float32) for k in names}
        ws = [k for k in names if k.endswith("proj.weight")]
        if ws:
            break
    w = ws[0]
    tensors[w] = tensors[w].copy()
    tensors[w].flat[0] = np.nan
    os.remove(shard)
    st.write(shard, tensors, dtypes=dtypes)
    out = tmp_path / "ad"
    r = command(d, "--source", str(nan), "--source-tuned", "A_ft",
                "--target", "B", "--text", "task.txt", "--output-lora",
                str(out), "--method", "distill", "--window", "32",
                "--windows", "24", "--steps", "5", "--rank", "2", "--quiet",
                ok=False)
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "source model's outputs" in last and "finite" in last, last
    assert "Traceback" not in r.stderr
    assert not out.exists()



def test_the_layers_are_checkpointed_only_where_activations_are_large(
        monkeypatch):
    """Student(checkpoint="auto") checkpoints the target's layers when a
    step's activations (4 bytes x tokens x layers x (12 d + 4 f)) would
    pass a quarter of the memory available, at least CHECKPOINT_BYTES:
    a 128-wide 4-layer decoder's 8 x 64 tokens (24 MB) never; a
    Qwen2-0.5B shape's 8 x 128 (3.0 GB) with 4 GB available, or with
    the memory unknown, yes, with 20 GB available no; a model of unknown
    size always; True and False as given."""
    import torch
    from bico.llm import distill as ld

    class M(object):
        def __init__(self, cfg):
            self.config = cfg
    small = M({"hidden_size": 128, "intermediate_size": 344,
               "num_hidden_layers": 4})
    half = M({"hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24})
    x8 = [torch.zeros(8, 64, dtype=torch.long), None]
    x8b = [torch.zeros(8, 128, dtype=torch.long)]
    assert 4 * 512 * 4 * (12 * 128 + 4 * 344) < ld.CHECKPOINT_BYTES
    for avail, want in ((None, True), (4 << 30, True), (20 << 30, False)):
        monkeypatch.setattr(ld, "_available", lambda dev, v=avail: v)
        assert not ld._checkpointed(small, x8)
        assert ld._checkpointed(half, x8b) == want, avail
        assert ld._checkpointed(M(None), x8)
        assert ld._checkpointed(small, x8, True)
        assert not ld._checkpointed(half, x8b, False)
    with pytest.raises(BicoError, match="checkpoint"):
        ld.run(None, None, None, None, print,
               student=ld.Student(checkpoint="yes"))
