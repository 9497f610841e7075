"""bico.llm.generate: the teacher writes task text (a few windows are
enough).  The key-value cache gives the logits of a forward over the whole
sequence (an identity, in float64, for grouped-query attention, an untied
head and Mistral's sliding window); the sampler draws from the nucleus it
says; prompts come from the fit windows only; the written windows follow
the teacher softmax(z_B + z_A_ft - z_A) (planted: with A_ft = A the
teacher is B, and a greedy writer writes B's own greedy text); the command
adds the windows to the distillation and never to the held-out ones."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import bico.llm.families as fam
from bico._status import BicoError
from bico.llm.generate import Writer, perturb, prompts, sample_next, write

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402
import llm_pair  # noqa: E402

torch.set_num_threads(1)


def _model(tmp, **kw):
    cfg = llama.default_config(vocab_size=50, hidden_size=24,
                               intermediate_size=40, num_hidden_layers=2,
                               num_attention_heads=6, num_key_value_heads=2,
                               max_position_embeddings=64, **kw)
    sd = llama.random_state(cfg, torch.Generator().manual_seed(3))
    llama.write_folder(str(tmp), cfg, sd)
    return fam.load_model(str(tmp), dtype=torch.float64)


@pytest.mark.parametrize("kw", [
    {}, {"tie_word_embeddings": False},
    {"model_type": "mistral", "sliding_window": 5}],
    ids=["gqa", "untied", "sliding-window"])
def test_the_cache_gives_the_whole_sequences_logits(tmp_path, kw):
    m = _model(tmp_path, **kw)
    ids = torch.randint(0, 50, (3, 17), generator=torch.Generator()
                        .manual_seed(0))
    full = m(ids)
    cache = m.new_cache()
    got = [m.step(ids[:, :4], cache)]          # a prompt, then one by one
    for t in range(4, 17):
        got.append(m.step(ids[:, t:t + 1], cache))
    assert torch.allclose(got[0], full[:, 3], atol=1e-12, rtol=0)
    assert torch.allclose(torch.stack(got[1:], 1), full[:, 4:], atol=1e-12,
                          rtol=0)
    assert cache[0][0].shape[2] == 17


def test_the_sampler_draws_from_the_nucleus():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    z = p.log().repeat(20000, 1)
    assert sample_next(z, 0.0).eq(0).all()         # temperature 0: argmax
    draws = sample_next(z, 1.0, 0.7, g)            # nucleus {0, 1}: 0.8
    counts = torch.bincount(draws, minlength=4).double() / len(draws)
    assert counts[2] == 0 and counts[3] == 0
    assert abs(counts[0] - 0.5 / 0.8) < 0.02
    draws = sample_next(z, 1.0, 1.0, g)            # everything
    counts = torch.bincount(draws, minlength=4).double() / len(draws)
    assert torch.allclose(counts, p.double(), atol=0.015)
    # a high temperature flattens, a low one sharpens
    hot = sample_next(z, 100.0, 1.0, g)
    assert abs(torch.bincount(hot, minlength=4)[3].item() / len(hot) -
               0.25) < 0.03


def test_prompts_come_from_the_fit_windows_only():
    fit = [(torch.arange(0, 20).view(2, 10), torch.arange(1, 21).view(2, 10))]
    p = prompts(fit, 7, 4, seed=1)
    whole = torch.arange(0, 21).tolist()
    assert p.shape == (7, 4)
    for row in p.tolist():      # a span of one window: consecutive ids
        assert row == list(range(row[0], row[0] + 4)) and row[0] in whole
    with pytest.raises(BicoError):
        prompts(fit, 3, 12)     # longer than a window (10 + 1)
    assert torch.equal(prompts(fit, 7, 4, seed=1), p)


def test_a_teacher_whose_pair_agrees_is_the_target(tmp_path):
    """With A_ft = A the teacher softmax(z_B + z_A - z_A) is the target:
    a greedy writer continues each prompt as the target's own greedy
    decoding does (computed here without a cache)."""
    a = _model(tmp_path / "a")
    b = _model(tmp_path / "b", rope_theta=500.0)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.01 * torch.randn(p.shape, dtype=p.dtype,
                                      generator=torch.Generator()
                                      .manual_seed(5)))
    prompt = torch.randint(0, 50, (2, 3), generator=torch.Generator()
                           .manual_seed(2))
    got = Writer((a, a, b), temperature=0.0).batch(prompt, 12)
    seq = prompt
    with torch.no_grad():
        while seq.shape[1] < 12:
            seq = torch.cat([seq, b(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, seq)


def test_written_windows_are_batches_of_the_calibration_shape(tmp_path):
    m = _model(tmp_path)
    fit = [(torch.randint(0, 50, (4, 9)), torch.randint(0, 50, (4, 9)))]
    out = write((m, m, m), fit, 10, 9, batch_size=4, seed=0)
    assert [x.shape for x, _ in out] == [(4, 9), (4, 9), (2, 9)]
    for x, y in out:       # (ids, next ids) of windows of 10 tokens
        assert torch.equal(x[:, 1:], y[:, :-1])
    again = write((m, m, m), fit, 10, 9, batch_size=4, seed=0)
    assert all(torch.equal(x, x2) for (x, _), (x2, _) in zip(out, again))
    kept = write((m, m, m), fit, 10, 9, batch_size=4, seed=0, keep=0.5)
    assert sum(len(x) for x, _ in kept) == 5


def test_perturbed_windows_keep_the_users_text_but_a_share(tmp_path):
    """perturb: each window is a fit window with about `share` of its
    tokens (never the first) resampled; share 0 gives the windows back;
    a teacher that puts all its mass on one token writes that token at
    every resampled place."""
    m = _model(tmp_path)
    g = torch.Generator().manual_seed(4)
    w = torch.randint(0, 50, (6, 41), generator=g)
    fit = [(w[:3, :-1], w[:3, 1:]), (w[3:, :-1], w[3:, 1:])]
    same = perturb((m, m, m), fit, 6, 0.0, batch_size=6)
    got = torch.cat([same[0][0], same[0][1][:, -1:]], 1)
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, w.tolist()))
    out = perturb((m, m, m), fit, 60, 0.3, batch_size=60, seed=1)
    x, y = out[0]
    full = torch.cat([x, y[:, -1:]], 1)
    changed = 0
    for r in full:
        src = w[int((w == r).sum(1).argmax())]   # the window it came from
        assert src[0] == r[0]                    # never the first token
        changed += int((r != src).sum())
    frac = changed / (60 * 40)
    assert 0.2 < frac < 0.35, frac          # about 0.3 (some draws agree)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    llm_pair.make(str(d))
    return d


def _distil(pair, out, *extra):
    """python3 -m bico.llm --method distill on the pair's folders (24
    windows of 32 tokens, rank 2, the adapter to out) with extra options;
    its stderr."""
    r = subprocess.run(
        [sys.executable, "-m", "bico.llm", "--source", "A", "--lora",
         "A_adapter", "--target", "B", "--text", "task.txt", "--output-lora",
         str(out), "--window", "32", "--windows", "24", "--method",
         "distill", "--rank", "2"] + list(extra), cwd=str(pair),
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
        text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr


def test_the_command_distils_on_the_written_windows_too(pair, tmp_path):
    """--generate N: N windows written by the teacher join the fit
    windows (the teacher's batches grow by N / batch size), the held-out
    windows stay the user's (the untouched target's held-out loss is the
    same as without them), and the adapter is written."""
    def run(n):
        return _distil(pair, tmp_path / ("ad%d" % n), "--steps", "20",
                       "--generate", str(n))
    none, some = run(0), run(16)

    def line(err, start):
        return [x for x in err.splitlines() if x.startswith(start)][-1]
    assert "generate:" not in none and "writes 16 windows" in some
    assert line(none, "teacher:").split()[1] == "3"      # 21 / 8
    assert line(some, "teacher:").split()[1] == "5"      # + 16 / 8
    zero = [line(e, "held-out next-token loss").split("target ")[1]
            .split(";")[0] for e in (none, some)]
    assert zero[0] == zero[1]
    assert os.path.exists(tmp_path / "ad16" / "adapter_model.safetensors")
    # the estimate comes before the writing and is kept with the output
    est = [x for x in some.splitlines() if "for the distillation" in x][-1]
    assert some.index(est) < some.index("teacher:")
    assert "writing 16 windows" in est and "for all 20 steps" in est
    import bico.safetensors as bst
    with bst.open(str(tmp_path / "ad16" / "adapter_model.safetensors")) as f:
        meta = f.metadata
    assert float(meta["bico_estimate_seconds"]) > 0
    # without written windows, the distillation's own estimate (not the
    # fit's) before its steps, kept with the output too
    est = [x for x in none.splitlines() if x.startswith("estimate:")]
    assert len(est) == 1 and "for the distillation" in est[0], none
    assert "at most" in est[0] and "(20 steps" in est[0]
    assert none.index(est[0]) < none.index("distill steps:")
    with bst.open(str(tmp_path / "ad0" / "adapter_model.safetensors")) as f:
        assert float(f.metadata["bico_estimate_seconds"]) > 0


def test_the_schedule_is_the_short_one_only_when_most_text_is_written(
        pair, tmp_path):
    """Without --steps, the distillation runs WRITTEN_STEPS (400) when
    the teacher wrote more windows than the user gave, and the default
    schedule (20 passes over the batches, at least 200 steps) when the
    user's windows are the most (measured: 400 steps lost 12 points of
    the gap from 512 windows).  --patience 1 ends both runs early."""
    from bico.llm.command.arguments import WRITTEN_STEPS

    def steps(n):
        err = _distil(pair, tmp_path / ("ad%d" % n), "--patience", "1",
                      "--generate", str(n))
        head = [x for x in err.splitlines()
                if x.startswith("distill: LoRA rank")][-1]
        return int(head.split(", ")[-1].split()[0])
    assert WRITTEN_STEPS == 400
    assert steps(16) == 200          # 21 fit windows of the user's, 16
    assert steps(48) == 400          # 21 of the user's, 48 written
