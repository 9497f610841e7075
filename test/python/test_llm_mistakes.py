"""python3 -m bico.llm's exit status rule (bico.llm.options): every user
mistake is one line on stderr naming the option (and the file), exit 2,
nothing written; a failure while running is exit 1.  A table of
mistakes run through bico.llm.main(argv) in this process (the command's
own entry point; test_llm_command.py runs it as a subprocess), on the
tiny folders of test/e2e/llm_pair.py."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import bico.llm

HERE = os.path.dirname(os.path.abspath(__file__))
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

# Every option that takes a number is bounded (issue 45): by the machine
# where that is the sense (threads by the CPUs, memory by the machine's),
# else far beyond any real use; beyond it, one line and exit 2, before
# anything runs (before: thousands of threads started, tracebacks after
# minutes of work, Inf or all-zero factors written with exit 0).
BOUNDS = [
    ("--threads above the CPUs", {"--threads": "1000000"},
     ["--threads", "1000000", "CPUs"]),
    ("--memory-budget 1e308", {"--memory-budget": "1e308"},
     ["--memory-budget", "1e308", "memory"]),
    ("--teacher-memory 1e308", {"--teacher-memory": "1e308"},
     ["--teacher-memory", "1e308", "memory"]),
    ("--rank 10**12", {"--rank": str(10 ** 12)}, ["--rank", str(10 ** 12)]),
    ("--lr 1e308", {"--lr": "1e308"}, ["--lr", "1e308"]),
    ("--lora-alpha 1e-300", {"--lora-alpha": "1e-300"},
     ["--lora-alpha", "scale"]),
    ("--lora-alpha 1e308", {"--lora-alpha": "1e308"},
     ["--lora-alpha", "scale"]),
    ("--wait 1e308", {"--wait": "1e308"}, ["--wait", "1e308"]),
    ("--text-weight 1e308", {"--text-weight": "1e308"}, ["--text-weight"]),
    ("--teacher-weight 1e308", {"--teacher-weight": "1e308"},
     ["--teacher-weight"]),
    ("--alpha 1e300", {"--alpha": "1e300"}, ["--alpha", "1e300"]),
    ("--ridge 1e300", {"--ridge": "1e300"}, ["--ridge", "1e300"]),
    ("--windows 10**12", {"--windows": str(10 ** 12)}, ["--windows"]),
    ("--batch-size 10**12", {"--batch-size": str(10 ** 12)},
     ["--batch-size"]),
    ("--steps 10**12", {"--steps": str(10 ** 12)}, ["--steps"]),
    ("--teacher-k 10**12", {"--teacher-k": str(10 ** 12)}, ["--teacher-k"]),
    ("--window 10**12", {"--window": str(10 ** 12)}, ["--window"]),
    ("--rank above the target's widths", {"--rank": "4096"},
     ["--rank", "4096", "widest layer"]),
]
MISTAKES += BOUNDS


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


@pytest.fixture
def deadline():
    """A test that would block forever fails instead, after the seconds
    given (SIGALRM's exception ends a blocking open() or read(): PEP
    475 retries a system call only when the handler returns)."""
    import signal

    class Late(Exception):
        pass

    def late(sig, frame):
        raise Late("still blocked after the deadline")
    old = signal.signal(signal.SIGALRM, late)
    yield lambda s: signal.alarm(s)
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _special(d):
    """Inputs that are not regular files: FIFOs in every place a file is
    read (with no writer, an open() for reading blocks forever), and the
    endless /dev/zero."""
    for name in ("text.fifo", "ids.fifo", "tok.fifo"):
        if not os.path.exists(d / name):
            os.mkfifo(d / name)
    for name, inner in (("B_fifo_tok", "tokenizer.json"),
                        ("B_fifo_cfg", "config.json")):
        if not os.path.exists(d / name):
            shutil.copytree(d / "B", d / name)
            os.remove(d / name / inner)
            os.mkfifo(d / name / inner)


SPECIAL = [
    ("--text a FIFO", {"--text": "text.fifo"}, ["--text", "text.fifo",
                                                "FIFO"]),
    ("--ids a FIFO", {"--ids": "ids.fifo"}, ["--ids", "ids.fifo", "FIFO"]),
    ("--tokenizer a FIFO", {"--tokenizer": "tok.fifo"},
     ["tok.fifo", "FIFO"]),
    ("the target's tokenizer.json a FIFO", {"--target": "B_fifo_tok"},
     ["tokenizer.json", "FIFO"]),
    ("the target's config.json a FIFO", {"--target": "B_fifo_cfg"},
     ["config.json", "FIFO"]),
    ("--text /dev/zero", {"--text": "/dev/zero"},
     ["--text", "/dev/zero", "character device"]),
]


@pytest.mark.parametrize("case,change,words", SPECIAL,
                         ids=[m[0] for m in SPECIAL])
@pytest.mark.parametrize("route", ["fit", "distill"])
def test_an_input_that_is_not_a_regular_file_is_refused_at_once(
        pair, tmp_path, capsys, deadline, case, change, words, route):
    """Every input is opened without blocking and refused unless it is a
    regular file (issue 45): a FIFO as --text, --ids, --tokenizer, a
    folder's tokenizer.json or config.json blocked the command forever;
    /dev/zero was read until the kernel's OOM killer came.  Now one line
    naming the file and what it is, exit 2, nothing written, at once."""
    _special(pair)
    out = tmp_path / "out"
    deadline(60)
    status, lines = run(argv(pair, out, dict(change, **{
        "--method": route})), capsys)
    assert status == 2, (status, lines)
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not os.path.exists(out)


def test_a_huge_text_is_read_only_as_far_as_the_windows_need(
        pair, tmp_path, capsys, monkeypatch):
    """--text is read as a stream, up to what the windows need: a text
    larger than the reader's limit is read as pieces spread over it
    (bico.llm.text.read_text), never whole (before: read whole before
    the window cap applied; 22 GB, then the OOM killer).  A sparse file of
    64 GiB of NUL bytes with the task text at its start: the run reads a
    bounded number of bytes and refuses nothing but what it must."""
    import bico.llm.text as bt
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(open(pair / "task.txt", "rb").read())
        f.truncate(64 << 30)
    seen = []
    real = bt.open_input

    def counted(path, what=None):
        f = real(path, what)
        orig = f.read

        def read(n=-1):
            b = orig(n)
            seen.append(len(b))
            return b
        f.read = read
        return f
    monkeypatch.setattr(bt, "open_input", counted)
    text = bt.read_text(str(big), "--text", limit=1 << 20)
    assert sum(seen) <= (1 << 20) + bt.PIECES and len(text) <= (1 << 20) + \
        bt.PIECES
    assert text.startswith(open(pair / "task.txt").read()[:100])
    # a text within the limit is read whole, as before
    small = bt.read_text(str(pair / "task.txt"), "--text")
    assert small == open(pair / "task.txt", encoding="utf-8").read()


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
