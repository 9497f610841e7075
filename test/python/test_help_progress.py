"""`bico --help` texts come from the manual (docs/bico.1.md) and cover the
parser; progress is a bar on a terminal and plain text otherwise."""
import json
import os
import pty
import re
import subprocess

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
import planted as pl  # noqa: E402

from cli import BICO, bico  # noqa: E402

# Each command's parser: the sources whose string literals are its options.
PARSERS = {"transfer": ["transfer.c", "lora_opts.c"], "merge": ["merge.c"],
           "stats": ["stats.c"], "inspect": ["inspect.c"], None: ["main.c"]}


def accepted(cmd):
    """Every "-x"/"--xyz" string literal of the command's parser sources
    (comments removed)."""
    opts = set()
    for f in PARSERS[cmd]:
        src = open(os.path.join(ROOT, "tools", "bico", f), encoding="utf-8").read()
        src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
        opts |= set(re.findall(r'"(--?[a-z][a-z0-9-]*)', src))
        if "cli_config_expand(" in src:   # tools/bico/config.c's --config
            opts.add("--config")
    return opts


def mentions(text, opt):
    return re.search(r"(?<![\w-])" + re.escape(opt) + r"(?![\w-])", text)


def test_every_accepted_option_is_in_the_help():
    for cmd in PARSERS:
        opts = accepted(cmd)
        assert "--help" in opts or cmd is None
        args = [cmd, "--help"] if cmd else ["--help"]
        text = bico(*args).stdout
        missing = [o for o in sorted(opts) if not mentions(text, o)]
        assert not missing, (cmd, missing)


def manual_section(cmd):
    text = open(os.path.join(ROOT, "docs", "bico.1.md"), encoding="utf-8").read()
    head = "### bico" + (" " + cmd if cmd else "") + "\n"
    body = text.split(head, 1)[1]
    return re.split(r"\n##", body, maxsplit=1)[0]


def test_every_option_the_manual_lists_is_accepted_and_in_the_help():
    for cmd in PARSERS:
        sec = manual_section(cmd)
        terms = [ln for ln in sec.splitlines() if ln.startswith("`-")]
        documented = set()
        for t in terms:
            documented |= set(re.findall(r"`(--?[a-z][a-z0-9-]*)", t))
        assert documented, cmd
        opts = accepted(cmd) | (accepted(None) if cmd else set())
        # --source-base & co are files of transfer's table of file options
        assert documented <= opts, (cmd, sorted(documented - opts))
        args = [cmd, "--help"] if cmd else ["--help"]
        text = bico(*args).stdout
        # the help holds the manual's lines (markdown quotes dropped)
        for ln in sec.splitlines():
            plain = ln.replace("`", "").strip()
            if plain.startswith(": "):
                plain = plain[2:]
            assert plain in text, (cmd, plain)


def test_help_is_generated_not_written_by_hand():
    for f in ("transfer.c", "merge.c", "stats.c", "inspect.c", "main.c"):
        src = open(os.path.join(ROOT, "tools", "bico", f), encoding="utf-8").read()
        assert "BICO_HELP_" in src and "usage: bico" not in src, f


def _models(tmp_path, n=12):
    rng = np.random.default_rng(5)
    sd = {f"blocks.{i}.fc.weight": rng.standard_normal((8, 8)).astype(np.float32)
          for i in range(n)}
    ft = {k: v + 0.01 for k, v in sd.items()}
    pl.save(str(tmp_path / "a.safetensors"), sd)
    pl.save(str(tmp_path / "aft.safetensors"), ft)
    return ["transfer", "--method", "naive", "--source-base", tmp_path / "a.safetensors",
            "--source-tuned", tmp_path / "aft.safetensors",
            "--target-base", tmp_path / "a.safetensors"]


def test_progress_bar_on_a_terminal(tmp_path):
    args = _models(tmp_path)
    master, slave = pty.openpty()
    p = subprocess.Popen([BICO, *map(str, args), "--output", tmp_path / "o.safetensors"],
                         stderr=slave, stdout=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    assert p.wait() == 0
    os.close(master)
    text = out.decode()
    # the last drawing: a full bar, all tensors, elapsed and left
    draws = [d for d in text.split("\r") if d.startswith("[")]
    assert draws, text
    last = draws[-1].split("\n")[0]
    assert re.match(r"\[#{30}\] bico: 100% \(12/12 tensors\), \d+:\d\d elapsed, "
                    r"~0:00 left", last), last
    assert "\x1b[K" in text
    # the summary comes on its own line after the bar
    assert re.search(r"left\x1b\[K\r?\n.*tensors updated", text, re.S), text


def test_no_bar_and_no_escapes_when_not_a_terminal(tmp_path):
    args = _models(tmp_path)
    r = bico(*args, "--output", tmp_path / "o.safetensors")
    assert "\r" not in r.stderr and "\x1b" not in r.stderr and "[#" not in r.stderr
    assert "tensors updated" in r.stderr
    r = bico(*args, "--quiet", "--output", tmp_path / "q.safetensors")
    assert r.stderr == ""
