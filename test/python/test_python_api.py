"""The Python API frozen for 1.x (abi/python-1.txt, written by
scripts/python-api.py): every frozen name is still there, of the same
kind, with a signature its callers still fit (parameters kept in order,
new ones only appended with a default) and the same constant values; and
the rule itself catches planted breaks."""
import importlib.util
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FROZEN = os.path.join(ROOT, "abi", "python-1.txt")


def _api():
    spec = importlib.util.spec_from_file_location(
        "python_api", os.path.join(ROOT, "scripts", "python-api.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_package_keeps_the_frozen_api():
    pytest.importorskip("torch")
    api = _api()
    frozen = api.parse(open(FROZEN).read())
    assert len(frozen) > 300
    breaks, _ = api.compare(frozen, api.entries())
    assert not breaks, "\n".join(breaks)


@pytest.mark.parametrize("now, why", [
    ({}, "removed"),
    ({"m.f": ("class", "(a, b=1)")}, "was a function"),
    ({"m.f": ("function", "(a)")}, "parameters changed"),
    ({"m.f": ("function", "(a, b=2)")}, "parameters changed"),
    ({"m.f": ("function", "(b=1, a=0)")}, "parameters changed"),
    ({"m.f": ("function", "(a, x=0, b=1)")}, "inserted before"),
    ({"m.f": ("function", "(a, b=1, *, c)")}, "without a default"),
])
def test_a_planted_break_is_caught(now, why):
    api = _api()
    frozen = {"m.f": ("function", "(a, b=1)")}
    breaks, _ = api.compare(frozen, now)
    assert len(breaks) == 1 and why in breaks[0], breaks


def test_compatible_changes_pass_and_additions_are_listed():
    api = _api()
    frozen = {"m.f": ("function", "(a, b=1)"), "m.K": ("value", "3"),
              "m.C": ("class", "(x, dtype=<class 'numpy.float32'>)")}
    now = {"m.f": ("function", "(a, b=1, c=None, *args, d=2, **kw)"),
           "m.K": ("value", "3"), "m.g": ("function", "()"),
           "m.C": ("class", "(x, dtype=<class 'numpy.float32'>, y=0)")}
    assert api.compare(frozen, now) == ([], ["m.g"])
    assert api.compare({"m.K": ("value", "3")},
                       {"m.K": ("value", "4")})[0] == [
        "m.K: value changed from 3 to 4"]


def test_the_listing_reads_back():
    pytest.importorskip("torch")
    api = _api()
    ent = api.entries()
    assert api.parse(api.listing(ent)) == ent
