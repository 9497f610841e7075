"""bico.torch.choose.pick, the one held-out choice every route calls, on
planted losses whose answer is worked out here by hand: the least mean
loss, the earlier candidate on a tie; "clear" keeps only the candidates
whose per-batch gain over the untouched target (candidate 0) exceeds its
standard error; "least-or-zero" takes the least, then falls back to the
target unless that one beats it clearly."""
import math

import pytest

pytest.importorskip("torch")

import bico  # noqa: E402
from bico.torch.choose import pick, _helps  # noqa: E402


def mean(v):
    return sum(v) / len(v)


def test_least_loss_and_the_earlier_candidate_on_a_tie():
    assert pick({0.0: 3.0, 0.5: 2.0, 1.0: 2.5}) == 0.5
    assert pick({0.0: 3.0, 0.5: 2.0, 1.0: 2.0}) == 0.5      # tie: smaller
    assert pick({0: 1.0, 25: 1.0}) == 0
    assert pick({"only": 7.0}) == "only"
    # a NaN loss after the first candidate is passed over
    assert pick({0.0: 2.0, 0.5: float("nan"), 1.0: 1.5}) == 1.0


# per-batch held-out losses: candidate 1 gains 0.1 on every batch (a
# clear gain), candidate 2 gains more on average but noisily (mean gain
# 0.2, standard error 0.2 * sqrt(...)): worked out below
ZERO = [2.0, 2.0, 2.0, 2.0]
STEADY = [1.9, 1.9, 1.9, 1.9]
NOISY = [1.2, 2.8, 1.2, 2.0]


def test_the_standard_error_rule():
    gains = [z - c for z, c in zip(ZERO, NOISY)]        # .8 -.8 .8 0
    m = mean(gains)
    se = math.sqrt(sum((g - m) ** 2 for g in gains) / 3 / 4)
    assert m == pytest.approx(0.2) and se > m           # not clear
    assert not _helps(ZERO, NOISY)
    assert _helps(ZERO, STEADY)                         # zero variance
    assert _helps([2.0], [1.9]) and not _helps([2.0], [2.0])  # one batch


def test_clear_keeps_the_candidates_that_beat_zero_clearly():
    per = {0.0: ZERO, 0.5: STEADY, 1.0: NOISY}
    losses = {k: mean(v) for k, v in per.items()}
    assert pick(losses) == 1.0                    # least mean: the noisy
    assert pick(losses, per, rule="clear") == 0.5     # the steady one
    # nothing clear: the target
    per = {0.0: ZERO, 1.0: NOISY}
    assert pick({k: mean(v) for k, v in per.items()}, per,
                rule="clear") == 0.0
    # without the target among the candidates: the least
    per = {0.5: STEADY, 1.0: NOISY}
    assert pick({k: mean(v) for k, v in per.items()}, per,
                rule="clear") == 1.0


def test_least_or_zero_falls_back_to_the_target():
    """Unlike "clear", the least is not replaced by the next clear one:
    proxy-distill's checkpoints (step 0 the target)."""
    per = {0: ZERO, 25: STEADY, 50: NOISY}
    losses = {k: mean(v) for k, v in per.items()}
    assert pick(losses, per, rule="least-or-zero", zero=0) == 0
    assert pick(losses, per, rule="clear", zero=0) == 25
    per = {0: ZERO, 25: STEADY}
    assert pick({k: mean(v) for k, v in per.items()}, per,
                rule="least-or-zero", zero=0) == 25


def test_an_unknown_rule_is_refused():
    with pytest.raises(bico.BicoError, match="rule.*'lowest'"):
        pick({0.0: 1.0}, rule="lowest")
