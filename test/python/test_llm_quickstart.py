"""docs/llm-quickstart.md runs as written: its `sh` and `python` blocks,
in order, in a folder holding the tiny models the page describes
(test/e2e/llm_pair.py), with `python3` this interpreter and `bico` the
built tool; what they write is then checked from outside (the adapters
load with libbico's reader, the folders with load_model, and the fitted
results lower the loss on held-out task text below the untouched
target's)."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import torch

import bico.lora as bl
import bico.llm as llm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
import llm_pair  # noqa: E402

BUILD = os.path.abspath(os.environ.get("BICO_BUILD",
                                       os.path.join(ROOT, "build")))


def blocks():
    text = open(os.path.join(ROOT, "docs", "llm-quickstart.md")).read()
    return re.findall(r"```(sh|python)\n(.*?)```", text, re.S)


def test_readme_links_the_quickstart_on_its_first_screen():
    head = "\n".join(open(os.path.join(ROOT, "README.md")).read()
                     .splitlines()[:40])
    assert "docs/llm-quickstart.md" in head


def test_quickstart_runs(tmp_path, monkeypatch, capsys):
    torch.set_num_threads(1)
    info = llm_pair.make(str(tmp_path))
    shim = tmp_path / "_bin"
    shim.mkdir()
    os.symlink(sys.executable, shim / "python3")
    os.symlink(os.path.join(BUILD, "bin", "bico"), shim / "bico")
    env = dict(os.environ, PATH="%s:%s" % (shim, os.environ["PATH"]),
               OMP_NUM_THREADS="1")
    monkeypatch.chdir(tmp_path)
    bl_ = blocks()
    assert sum(1 for k, _ in bl_ if k == "sh") >= 4
    assert sum(1 for k, _ in bl_ if k == "python") >= 1
    scope = {"__name__": "__quickstart__"}
    for kind, code in bl_:
        if kind == "python":
            exec(compile(code, "docs/llm-quickstart.md", "exec"), scope)
        else:
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", code],
                               cwd=str(tmp_path), env=env,
                               capture_output=True, text=True, timeout=1200)
            assert r.returncode == 0, (code, r.stderr[-3000:])
    capsys.readouterr()
    for ad in ("B_adapter", "B_adapter_py", "B_bico_adapter"):
        cfg = json.load(open(tmp_path / ad / "adapter_config.json"))
        assert cfg["peft_type"] == "LORA"
        assert bl.Adapter.open(str(tmp_path / ad)).modules()
    cal = llm.text_batches(str(tmp_path / "eval.txt"), 32, holdout=0,
                          tokenizer=str(tmp_path / "B"))

    def loss(folder):
        return llm.lm_loss(llm.load_model(tmp_path / folder,
                                        dtype=torch.float32), cal.batches)
    zero = loss("B")
    gap = zero - info["loss_ft"]
    for folder in ("B_merged", "B_ft"):
        assert loss(folder) < zero - 0.3 * gap, folder
    assert np.isfinite(loss("B_bico"))
    # the statistics of `python3 -m bico.llm stats`: the module pairs of
    # the Python-collected file
    import bico.safetensors as st
    a = st.open(str(tmp_path / "stats_cli.safetensors"))
    b = st.open(str(tmp_path / "stats.safetensors"))
    assert sorted(a.keys()) == sorted(b.keys())


def test_the_ids_one_liner_uses_the_targets_tokenizer(tmp_path):
    """The page's --ids one-liner, run where B's tokenizer is a byte-level
    BPE whose ids are not byte values (its vocabulary permuted), writes
    B's token ids (the one-liner used to write raw bytes)."""
    line = next(l for k, code in blocks() if k == "sh"
                for l in code.splitlines() if "ids.npy" in l and
                l.startswith("python3 -c"))
    text = "key=lfz;\nabc=bcd;\n\u00e9t\u00e9\n" * 20
    (tmp_path / "task.txt").write_text(text, encoding="utf-8")
    os.makedirs(tmp_path / "B")
    spec = llm_pair.tokenizer_json()
    vocab = spec["model"]["vocab"]
    perm = np.random.default_rng(1).permutation(len(vocab))
    spec["model"]["vocab"] = {t: int(perm[i]) for t, i in vocab.items()}
    json.dump(spec, open(tmp_path / "B" / "tokenizer.json", "w"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "bindings", "python"),
         os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(["bash", "-c", line.replace("python3",
                                                   sys.executable, 1)],
                       cwd=str(tmp_path), env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "ids.npy")
    want = llm.tokenize(text, str(tmp_path / "B")).numpy()
    assert got.dtype.kind == "i" and np.array_equal(got, want)
    raw = np.frombuffer(text.encode(), np.uint8)
    assert not np.array_equal(want, raw)
