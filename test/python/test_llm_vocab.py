"""The distillation across tokenizers (bico.llm.vocab, bico.llm.bpe): the
relation of two tokenizers is told and said (one, a vocabulary that grew,
or two different ones), never silently refused.  A grown vocabulary's
teacher is exact on the shared ids (planted: B_grown is B with rows added,
its teacher equals B's); across different tokenizers the fine-tuned
source writes the text and the target learns it in its own tokens, with
the teacher on the next token's first byte, end to end through the
command, its adapter loaded as PEFT loads it and its
held-out loss below the untouched target's.  The native byte-level BPE
runs text both ways (decode(encode(t)) = t) and learns merges that make a
frequent word one token.  Tiny folders of test/e2e/llm_pair.py."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import bico.llm as bl
from bico.llm.bpe import ByteLevelBPE, train
from bico.llm.text import load_tokenizer
from bico.llm.vocab import relation

HERE = os.path.dirname(os.path.abspath(__file__))
import llm_pair  # noqa: E402
import peft_rules  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab")
    info = llm_pair.make(str(d))
    llm_pair.grown_target(str(d), info)
    tok = llm_pair.bpe_target(str(d))
    return d, info, tok


def test_bpe_runs_text_both_ways_and_learns_merges():
    text = "the cat sat on the mat. " * 50 + "naïve café 日本 _x_ 123 it's"
    tok = train(text, 300)
    assert 256 < len(tok) <= 300     # stops when no pair repeats
    for t in (text, "héllo wörld\n\n  tabs\tand 12345 don't", "", " "):
        assert tok.decode(tok.encode(t)) == t
    assert len(tok.encode(" the")) == 1          # frequent: one token
    assert len(tok.encode(text)) < len(text.encode()) / 2
    again = ByteLevelBPE.from_spec(json.loads(json.dumps(tok.spec())))
    assert again.encode(text) == tok.encode(text)
    special = train(text, 300, added=["<|end|>"])
    ids = special.encode("a<|end|>b")
    assert special.added["<|end|>"] in ids and \
        special.decode(ids) == "a<|end|>b"


def test_the_relation_of_two_tokenizers(pair):
    d, _, _ = pair
    text = open(d / "task.txt").read()
    assert relation(d / "A", d / "B", text).kind == "same"
    grown = relation(d / "A", d / "B_grown", text)
    assert grown.kind == "grown" and grown.shared == 256
    assert relation(d / "A", d / "B_bpe", text).kind == "different"
    # a text that uses a token the grown vocabulary added: not the same
    # ids with both, so not "grown"
    assert relation(d / "A", d / "B_grown", text + "<|extra_3|>").kind == \
        "different"


def test_a_grown_vocabulary_gives_the_shared_teacher(pair):
    """B_grown is B with embedding rows added: the teacher over the
    source's 256 ids from (A, A_ft, B_grown) equals the one from (A, A_ft,
    B), computed from the folders a block at a time."""
    from bico.llm.stream.teacher import build
    d, _, _ = pair
    ids = llm_pair.byte_ids(open(d / "task.txt").read())[:4 * 33]
    wins = ids.view(4, 33)
    batches = [(wins[:2, :-1], wins[:2, 1:]), (wins[2:, :-1], wins[2:, 1:])]
    t1 = build(str(d / "A"), str(d / "A_ft"), str(d / "B"), batches,
               dtype=torch.float64, k=None)
    t2 = build(str(d / "A"), str(d / "A_ft"), str(d / "B_grown"), batches,
               dtype=torch.float64, k=None, shared=256)
    for i in range(2):
        assert torch.equal(t1.get(i), t2.get(i))
    assert t2.outputs == 256


def _command(d, target, *extra, method="distill"):
    return subprocess.run(
        [sys.executable, "-m", "bico.llm", "--source", "A", "--lora",
         "A_adapter", "--target", target, "--window", "32", "--windows",
         "24"] + (["--method", method] if method else []) + [
         "--rank", "4", "--steps", "150",
         "--generate", "48"] + list(extra), cwd=str(d),
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
        text=True, timeout=600)


def _eval_loss(model, d, tok):
    ids = torch.as_tensor(np.asarray(load_tokenizer(tok).encode(
        open(d / "eval.txt").read()), dtype=np.int64))
    cal = bl.text_batches(ids, 32, holdout=0)
    return bl.lm_loss(model, cal.batches)


def test_across_different_tokenizers_end_to_end(pair, tmp_path):
    """python3 -m bico.llm --source A --lora A_adapter --target B_bpe
    --text task.txt --output-lora ...: the two tokenizers are said, the
    fine-tuned source writes the text, the target learns it; the adapter
    loads as PEFT loads it, and on held-out task text (eval.txt, in the
    target's tokens) the loss is below the untouched target's."""
    d, _, _ = pair
    out = tmp_path / "ad"
    r = _command(d, "B_bpe", "--text", "task.txt", "--output-lora",
                 str(out), method=None)     # --method auto, the default
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokenizers: " in r.stderr and "differ" in r.stderr
    assert "--method auto: the tokenizers differ" in r.stderr
    assert "the fine-tuned source writes 48 windows" in r.stderr
    # the teacher on the next token's first byte (bico.llm.across): the
    # source's tokenizer has every byte a token, so every position but
    # those of a character a window's end cuts
    got = re.search(r"teacher: the next token's first byte .*, at (\d+) "
                    r"of (\d+) positions", r.stderr)
    assert got and int(got.group(1)) >= 0.9 * int(got.group(2)), \
        r.stderr[-3000:]
    model = bl.load_model(d / "B_bpe", dtype=torch.float32)
    zero = _eval_loss(model, d, d / "B_bpe")
    got = peft_rules.load(model, str(out))
    assert len(got["lora"]) == 21
    tuned = _eval_loss(model, d, d / "B_bpe")
    assert tuned < zero - 0.5, (tuned, zero)
    # --across text: the written text alone, no teacher
    r = _command(d, "B_bpe", "--text", "task.txt", "--output-lora",
                 str(tmp_path / "ad_text"), "--across", "text", method=None)
    assert r.returncode == 0 and "teacher: none" in r.stderr and \
        "(sequence-level distillation)" in r.stderr, r.stderr[-3000:]
    # token ids of one tokenizer mean nothing to the other: --ids refused
    np.save(tmp_path / "ids.npy", np.frombuffer(
        open(d / "task.txt", "rb").read(), np.uint8).astype(np.int64))
    r = _command(d, "B_bpe", "--ids", str(tmp_path / "ids.npy"),
                 "--output-lora", str(tmp_path / "ad2"))
    assert r.returncode == 2 and "--ids" in r.stderr and "--text" in \
        r.stderr, r.stderr
    assert not (tmp_path / "ad2").exists()


@pytest.mark.parametrize("extra", [("--method", "fit"),
                                   ("--method", "distill", "--init", "warm")])
def test_the_fit_across_different_tokenizers_is_refused(pair, tmp_path,
                                                        extra):
    """The fit takes token ids to mean the same in both models: with two
    tokenizers it (and the warm start that runs it) is refused at once,
    exit 2, naming both files and the route that works, nothing
    written."""
    d, _, _ = pair
    out = tmp_path / "ad"
    r = _command(d, "B_bpe", "--text", "task.txt", "--output-lora",
                 str(out), *extra[2:], method=extra[1])
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert extra[-2] + " " + extra[-1] in line
    assert "tokenizer.json" in line and "--method distill" in line
    assert "Traceback" not in r.stderr and not out.exists()


def test_a_grown_vocabulary_end_to_end(pair, tmp_path):
    d, info, _ = pair
    out = tmp_path / "ad"
    r = _command(d, "B_grown", "--text", "task.txt", "--output-lora",
                 str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "extends" in r.stderr and "top 64 of 256 outputs" in r.stderr
    model = bl.load_model(d / "B_grown", dtype=torch.float32)
    zero = _eval_loss(model, d, d / "B_grown")
    peft_rules.load(model, str(out))
    assert _eval_loss(model, d, d / "B_grown") < zero - 0.3 * (
        zero - info["loss_ft"])
