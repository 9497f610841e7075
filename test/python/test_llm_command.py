"""python3 -m bico.llm end to end on two folders written here
(test/e2e/llm_pair.py: widths 16 -> 32, depths 2 -> 3, sharded BF16, tied
heads, byte-level tokenizer.json) with a PEFT adapter of the source and a
task text: the adapter it writes loads onto the target with PEFT's names
and shapes (libbico's reader and merge), and lowers the next-token loss on
held-out task text (eval.txt, never seen by the command) below the
untouched target's; the same through --output as a model folder."""
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

HERE = os.path.dirname(os.path.abspath(__file__))
import llm_pair  # noqa: E402

torch.set_num_threads(1)
BICO = os.path.join(os.environ.get("BICO_BUILD", "build"), "bin", "bico")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    info = llm_pair.make(str(d))
    # the planted fine-tune helps the source, so there is a gap to carry
    assert info["loss_ft"] < info["loss_a"] - 0.5
    return d, info


def command(d, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "bico.llm"] + list(args),
                       cwd=str(d), env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def eval_loss(model, d):
    cal = llm.text_batches(str(d / "eval.txt"), 32, holdout=0,
                          tokenizer=str(d / "B"))
    return llm.lm_loss(model, cal.batches)


def test_adapter_from_a_lora_and_text(pair):
    d, info = pair
    r = command(d, "--source", "A/", "--lora", "A_adapter/", "--target", "B/",
                "--text", "task.txt", "--output-lora", "B_adapter/",
                "--method", "fit",
                "--rank", "8", "--window", "32")
    # progress per fitted layer and the choice, printed and recorded
    assert "fit: layer 1/" in r.stderr and "chosen: alpha" in r.stdout
    ad = d / "B_adapter"
    cfg = json.load(open(ad / "adapter_config.json"))
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8
    note = json.load(open(ad / "bico_adapter.json"))
    assert "bico_alpha" in note and "bico_ridge" in note
    meta = st.open(str(ad / "adapter_model.safetensors")).metadata
    assert meta["bico_alpha"] == note["bico_alpha"]
    # PEFT's names and shapes for every target linear of B; factors in
    # float32 (PEFT's convention, the one dtype rule of both routes)
    tgt = llm.load_model(d / "B")
    f = st.open(str(ad / "adapter_model.safetensors"))
    lin = [n for n, m in tgt.named_modules()
           if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for n in lin:
        w = tgt.get_submodule(n).weight
        assert f.info("base_model.model.%s.lora_A.weight" % n) == \
            ("F32", (8, w.shape[1]))
        assert f.info("base_model.model.%s.lora_B.weight" % n) == \
            ("F32", (w.shape[0], 8))
    assert sorted(bl.Adapter.open(str(ad)).modules()) == sorted(lin)
    # merged onto B by libbico: held-out task loss below zero-shot
    out = d / "merged.safetensors"
    subprocess.run([BICO, "transfer", "--method", "naive", "--source-base",
                    "B", "--target-base", "B", "--lora", "B_adapter",
                    "--output-lora", "carried", "--merge-into-base",
                    "--output", str(out), "--quiet"], cwd=str(d), check=True)
    merged = st.read(str(out), dtype=np.float32)
    zero = eval_loss(tgt.float(), d)
    sd = tgt.state_dict()
    sd.update({k: torch.from_numpy(v) for k, v in merged.items()})
    tgt.load_state_dict(sd)
    got = eval_loss(tgt, d)
    assert got < zero - 0.3 * (zero - info["loss_ft"]), (got, zero)


def test_full_folder_from_a_tuned_folder_and_ids(pair):
    d, info = pair
    ids = np.frombuffer(open(d / "task.txt", "rb").read(), np.uint8)
    np.save(d / "ids.npy", ids.astype(np.int64))
    r = command(d, "--source", "A", "--source-tuned", "A_ft", "--target", "B",
                "--ids", "ids.npy", "--output", "B_ft", "--window", "32",
                "--method", "fit",
                "--ridge", "0.01,0.1")
    assert "chosen: alpha" in r.stdout
    assert os.path.exists(d / "B_ft" / "model.safetensors.index.json")
    assert os.path.exists(d / "B_ft" / "tokenizer.json")
    new = llm.load_model(d / "B_ft")
    assert new.lm_head.weight is new.model.embed_tokens.weight
    assert all(v.dtype == torch.bfloat16 for v in new.state_dict().values())
    shard = sorted(n for n in os.listdir(d / "B_ft")
                   if n.startswith("model-"))[0]
    meta = st.open(str(d / "B_ft" / shard)).metadata
    assert meta["bico_ridge"] in ("0.01", "0.1") and "bico_alpha" in meta
    zero = eval_loss(llm.load_model(d / "B", dtype=torch.float32), d)
    got = eval_loss(new.float(), d)
    assert got < zero - 0.3 * (zero - info["loss_ft"]), (got, zero)


def test_refusals_name_the_input(pair, tmp_path):
    """User mistakes: one line naming the option, exit 2, nothing
    written (test_llm_mistakes.py has the whole table)."""
    d, _ = pair
    (tmp_path / "short.txt").write_text("abc=bcd;\n" * 10)
    r = subprocess.run([sys.executable, "-m", "bico.llm", "--source", "A",
                        "--source-tuned", "A_ft", "--target", "B", "--text",
                        str(tmp_path / "short.txt"), "--output",
                        str(tmp_path / "o"), "--window", "200"], cwd=str(d),
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--text %s" % (tmp_path / "short.txt") \
        in r.stderr and "window" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "o")
    r = subprocess.run([sys.executable, "-m", "bico.llm", "--source", "A",
                        "--source-tuned", "A_ft", "--target", "nowhere",
                        "--text", "task.txt", "--output", str(tmp_path / "o")],
                       cwd=str(d), capture_output=True, text=True)
    assert r.returncode == 2 and "--target nowhere" in r.stderr and \
        "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "bico.llm", "--source", "A",
                        "--source-tuned", "A_ft", "--target", "B",
                        "--text", "missing.txt", "--output",
                        str(tmp_path / "o")],
                       cwd=str(d), capture_output=True, text=True)
    assert r.returncode == 2 and "--text missing.txt" in r.stderr and \
        "Traceback" not in r.stderr, r.stderr


def test_fit_module_does_not_import_the_command():
    """bico.fit is the per-layer solver under bico.llm: it never imports
    bico.llm (the cycle fit -> llm -> fit is gone), and the command is
    bico.llm alone."""
    import ast
    import bico.fit as fit_mod
    tree = ast.parse(open(fit_mod.__file__).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [(node.module or "")] + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        assert not any(n in ("llm", "bico.llm") or n.endswith(".llm")
                       for n in names), ast.dump(node)
    r = subprocess.run([sys.executable, "-W", "error", "-m", "bico.llm",
                        "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--output-lora" in r.stdout, r.stderr


def test_no_import_cycle_among_the_binding_modules():
    """No module of the package reaches itself through its imports (those
    inside functions included): the graph of bico/*.py is acyclic."""
    import ast
    import glob
    import bico
    pkg = os.path.dirname(bico.__file__)
    deps = {}
    for f in glob.glob(os.path.join(pkg, "*.py")):
        m = os.path.basename(f)[:-3]
        d = set()
        for n in ast.walk(ast.parse(open(f).read())):
            if isinstance(n, ast.ImportFrom) and n.level == 1:
                d |= ({n.module.split(".")[0]} if n.module
                      else {a.name for a in n.names})
            elif isinstance(n, ast.ImportFrom) and \
                    (n.module or "").startswith("bico."):
                d.add(n.module.split(".")[1])
            elif isinstance(n, ast.Import):
                d |= {a.name.split(".")[1] for a in n.names
                      if a.name.startswith("bico.")}
        deps[m] = d - {"__init__"}
    for m in deps:
        seen, todo = set(), [m]
        while todo:
            for y in deps.get(todo.pop(), ()):
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        assert m not in seen, "import cycle through bico.%s" % m


def test_transformers_option_says_what_is_missing(pair, tmp_path):
    import importlib.util
    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed")
    d, _ = pair
    r = subprocess.run([sys.executable, "-m", "bico.llm", "--source", "A",
                        "--source-tuned", "A_ft", "--target", "B", "--text",
                        "task.txt", "--output", str(tmp_path / "o"),
                        "--transformers"], cwd=str(d), capture_output=True,
                       text=True)
    assert r.returncode == 2 and "transformers" in r.stderr and \
        "Traceback" not in r.stderr, r.stderr


def test_different_tokenizers_are_warned_about(pair, tmp_path):
    import shutil
    d, _ = pair
    shutil.copytree(d / "B", tmp_path / "B2")
    spec = json.load(open(d / "B" / "tokenizer.json"))
    spec["added_tokens"] = [{"id": 256, "content": "<x>"}]
    json.dump(spec, open(tmp_path / "B2" / "tokenizer.json", "w"))
    # refused after the models are read (a module name no model has), so
    # that the test stops early: the warning came before
    r = subprocess.run([sys.executable, "-m", "bico.llm", "--source", "A",
                        "--source-tuned", "A_ft", "--target",
                        str(tmp_path / "B2"), "--text", "task.txt",
                        "--output-lora", str(tmp_path / "o"),
                        "--modules-to-save", "nosuch"], cwd=str(d),
                       capture_output=True, text=True)
    assert "warning" in r.stderr and "differ" in r.stderr, r.stderr
    assert r.returncode == 2 and "--modules-to-save" in r.stderr
