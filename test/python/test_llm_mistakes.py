"""python3 -m bico.llm's exit status rule (bico.llm.options): every user
mistake is one line on stderr naming the option (and the file), exit 2,
nothing written; a failure while running is exit 1.  A table of
mistakes run through bico.llm.main(argv) in this process (the command's
own entry point; test_llm_command.py runs it as a subprocess), on the
tiny folders of test/e2e/llm_pair.py."""
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

import bico.llm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import llm_pair  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("mistakes")
    llm_pair.make(str(d))
    text = open(d / "task.txt", "rb").read()
    ids = np.frombuffer(text, np.uint8).astype(np.int64)
    np.save(d / "ids.npy", ids)
    np.save(d / "ids_300.npy", np.concatenate([ids, [300]]))
    np.save(d / "ids_neg.npy", np.concatenate([ids, [-3]]))
    np.save(d / "ids_float.npy", ids.astype(np.float64))
    (d / "ids_text.npy").write_text("1 2 3\n")
    (d / "latin1.txt").write_bytes(text[:200] + "caf\xe9".encode("latin-1")
                                   + text[200:])
    (d / "empty.txt").write_bytes(b"")
    (d / "short.txt").write_text("abc=bcd;\n")
    (d / "bad_tok.json").write_text("{\"model\": ")
    for name, edit in (("B_heads", lambda c: c.update(
            num_attention_heads=-4)), ("B_tok", None)):
        shutil.copytree(d / "B", d / name)
        if edit:
            cfg = json.load(open(d / name / "config.json"))
            edit(cfg)
            json.dump(cfg, open(d / name / "config.json", "w"))
    (d / "B_tok" / "tokenizer.json").write_text("not json")
    shutil.copytree(d / "A_adapter", d / "A_bad_adapter")
    (d / "A_bad_adapter" / "adapter_config.json").write_text("{")
    os.makedirs(d / "A_noweights")
    shutil.copy(d / "A" / "config.json", d / "A_noweights")
    return d


BASE = {"--source": "A", "--source-tuned": "A_ft", "--target": "B",
        "--text": "task.txt", "--window": "32"}


def argv(d, out, change):
    """BASE with change applied (a value None drops the option), the
    paths made absolute, --output-lora out."""
    opts = dict(BASE)
    for k, v in change.items():
        if k == "--lora" or k == "--ids":  # one of a mutually exclusive pair
            opts.pop({"--lora": "--source-tuned", "--ids": "--text"}[k])
        if v is None:
            opts.pop(k, None)
        else:
            opts[k] = v
    out_args = ["--output-lora", str(out), "--quiet"]
    args = []
    for k, v in opts.items():
        p = d / v
        args += [k, str(p) if k in ("--source", "--source-tuned", "--lora",
                                    "--target", "--text", "--ids",
                                    "--tokenizer") and not v.startswith("/")
                 else v]
    return args + out_args


def run(args, capsys):
    try:
        status = bico.llm.main(args)
    except SystemExit as e:   # argparse's usage errors
        status = e.code
    err = capsys.readouterr().err
    return status, [line for line in err.splitlines() if line.strip()]


# (case, options changed, words the one line must hold)
MISTAKES = [
    ("token id above the vocabulary", {"--ids": "ids_300.npy"},
     ["--ids", "ids_300.npy", "300", "vocabulary"]),
    ("a negative token id", {"--ids": "ids_neg.npy"}, ["--ids", "-3"]),
    ("token ids that are floats", {"--ids": "ids_float.npy"},
     ["--ids", "integers"]),
    ("--ids not a .npy file", {"--ids": "ids_text.npy"}, ["--ids", ".npy"]),
    ("--ids missing", {"--ids": "nothere.npy"}, ["--ids", "nothere.npy"]),
    ("--alpha inf", {"--alpha": "inf"}, ["--alpha", "inf"]),
    ("--alpha nan", {"--alpha": "nan"}, ["--alpha", "nan"]),
    ("--alpha negative", {"--alpha": "-1"}, ["--alpha", "-1"]),
    ("--alpha a word", {"--alpha": "best"}, ["--alpha", "best"]),
    ("hostile config.json", {"--target": "B_heads"},
     ["--target", "config.json", "num_attention_heads"]),
    ("--text not UTF-8", {"--text": "latin1.txt"},
     ["--text", "latin1.txt", "UTF-8"]),
    ("--text empty", {"--text": "empty.txt"}, ["--text", "empty.txt"]),
    ("--text too short for a window", {"--text": "short.txt"},
     ["--text", "short.txt", "window"]),
    ("--text missing", {"--text": "nothere.txt"}, ["--text", "nothere.txt"]),
    ("--tokenizer not JSON", {"--tokenizer": "bad_tok.json"},
     ["--tokenizer", "bad_tok.json", "JSON"]),
    ("the target's tokenizer.json not JSON", {"--target": "B_tok"},
     ["--target", "tokenizer.json", "JSON"]),
    ("--tokenizer missing", {"--tokenizer": "nothere.json"},
     ["--tokenizer", "nothere.json"]),
    ("--batch-size 0", {"--batch-size": "0"}, ["--batch-size", "0"]),
    ("--windows -1", {"--windows": "-1"}, ["--windows", "-1"]),
    ("--windows 0", {"--windows": "0"}, ["--windows"]),
    ("--window 0", {"--window": "0"}, ["--window", "0"]),
    ("--window above max_position_embeddings", {"--window": "257"},
     ["--window", "257", "max_position_embeddings", "256"]),
    ("--window not a number", {"--window": "32k"}, ["--window", "32k"]),
    ("--ridge ,", {"--ridge": ","}, ["--ridge", "','"]),
    ("--ridge garbage", {"--ridge": "lots"}, ["--ridge", "lots"]),
    ("--ridge negative in a list", {"--ridge": "0.1,-1"}, ["--ridge"]),
    ("--ridge nan", {"--ridge": "nan"}, ["--ridge", "nan"]),
    ("--source missing", {"--source": "nothere"}, ["--source", "nothere"]),
    ("--source a file", {"--source": "task.txt"}, ["--source", "task.txt"]),
    ("--source without weights", {"--source": "A_noweights"},
     ["--source", "A_noweights", "model.safetensors"]),
    ("--source-tuned missing", {"--source-tuned": "nothere"},
     ["--source-tuned", "nothere"]),
    ("--lora missing", {"--lora": "nothere"}, ["--lora", "nothere"]),
    ("--lora malformed", {"--lora": "A_bad_adapter"},
     ["--lora", "A_bad_adapter", "adapter_config.json"]),
    ("--target missing", {"--target": "nothere"}, ["--target", "nothere"]),
    ("--rank 0", {"--rank": "0"}, ["--rank"]),
    ("--lora-alpha 0", {"--lora-alpha": "0"}, ["--lora-alpha"]),
    ("--lora-alpha nan", {"--lora-alpha": "nan"}, ["--lora-alpha"]),
    ("--holdout 0", {"--holdout": "0"}, ["--holdout"]),
    ("--holdout 1.5", {"--holdout": "1.5"}, ["--holdout"]),
    ("--threads 0", {"--threads": "0"}, ["--threads"]),
    ("--seed -1", {"--seed": "-1"}, ["--seed"]),
    ("--modules-to-save of no module", {"--modules-to-save": "nrom"},
     ["--modules-to-save", "nrom"]),
    ("an unknown option", {"--sauce": "1"}, ["--sauce"]),
    ("--source left out", {"--source": None}, ["--source"]),
]


@pytest.mark.parametrize("case,change,words", MISTAKES,
                         ids=[m[0] for m in MISTAKES])
def test_a_user_mistake_is_one_line_exit_2_nothing_written(
        pair, tmp_path, capsys, case, change, words):
    out = tmp_path / "out"
    status, lines = run(argv(pair, out, change), capsys)
    assert status == 2, (status, lines)
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not os.path.exists(out)


def test_a_failure_while_running_is_exit_1(pair, tmp_path, capsys):
    """The output cannot be written (its parent is a file): found when
    the output folder is begun, before anything is loaded: exit 1, one
    line naming the option and the reason."""
    (tmp_path / "file").write_text("x")
    args = argv(pair, tmp_path / "file" / "out", {"--windows": "16"})
    status, lines = run(args, capsys)
    assert status == 1, (status, lines)
    assert "--output-lora" in lines[-1] and "not a folder" in lines[-1]
    assert not any("Traceback" in line for line in lines)


def test_the_help_states_the_rule(capsys):
    with pytest.raises(SystemExit) as e:
        bico.llm.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Exit status" in out and "2 a user mistake" in out
