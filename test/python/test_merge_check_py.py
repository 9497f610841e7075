"""bico.lora.merge_check: merge()'s arguments checked without the run
(bico_merge_check), from Python: a good configuration passes and writes
nothing, then merge() with the same arguments writes the output; each
broken option rule raises BicoError naming the input or the files, and
merge() with the same arguments refuses alike, nothing written."""
import os

import numpy as np
import pytest

import bico
from bico import lora
from bico import safetensors as st


def _files(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    p = {}
    for name, t in (("base", w), ("ft", w + 0.1)):
        p[name] = str(tmp_path / (name + ".safetensors"))
        st.write(p[name], {"l.weight": t})
    p["out"] = str(tmp_path / "out.safetensors")
    return p


def test_a_good_merge_checks_writes_nothing_then_runs(tmp_path):
    p = _files(tmp_path)
    ins = [("tuned", p["ft"], 1.0, 0.5)]
    assert lora.merge_check(p["base"], ins, p["out"], method="ties") is None
    assert not os.path.exists(p["out"])
    lora.merge(p["base"], ins, p["out"], method="ties")
    assert os.path.exists(p["out"])


@pytest.mark.parametrize("case", ["linear_density", "no_inputs", "same_path"])
def test_each_rule_is_refused_by_check_and_run(tmp_path, case):
    p = _files(tmp_path)
    kw = {}
    ins = [("tuned", p["ft"], 1.0, 1.0)]
    if case == "linear_density":
        ins = [("tuned", p["ft"], 1.0, 0.5)]
        says = [p["ft"], "density 0.5"]
    elif case == "no_inputs":
        ins = []
        says = ["no inputs"]
    else:
        kw["report"] = p["out"]
        says = ["the output file and the report file", p["out"]]
    for call in (lora.merge_check, lora.merge):
        with pytest.raises(bico.BicoError) as e:
            call(p["base"], ins, p["out"], **kw)
        for w in says:
            assert w in str(e.value)
        assert not os.path.exists(p["out"])


# `bico merge` leaves these rules to the library (bico_merge_check) and
# says them in its option words: a usage error (exit 2), nothing written,
# the option named and no library function's name.

from cli import bico as run_bico  # noqa: E402


@pytest.mark.parametrize("case", ["no_base", "no_output", "no_inputs",
                                  "linear_density", "density_range",
                                  "same_path"])
def test_the_command_says_the_library_rules_in_option_words(tmp_path, case):
    p = _files(tmp_path)
    rep = str(tmp_path / "rep.json")
    args = {"--base": p["base"], "--output": p["out"]}
    extra = ["--tuned", p["ft"]]
    says = []
    if case == "no_base":
        del args["--base"]
        says = ["--base"]
    elif case == "no_output":
        del args["--output"]
        says = ["--output"]
    elif case == "no_inputs":
        extra = []
        says = ["--task-vector", "--tuned", "--lora"]
    elif case == "linear_density":
        extra += ["--density", "0.5"]
        says = [p["ft"], "--density 0.5", "--method ties"]
    elif case == "density_range":
        extra += ["--method", "ties", "--density", "1.5"]
        says = [p["ft"], "--density 1.5", "(0, 1]"]
    else:
        args["--report"] = p["out"]
        says = ["--output", "--report", p["out"]]
    argv = [a for kv in args.items() for a in kv] + extra
    r = run_bico("merge", *argv, ok=False)
    assert r.returncode == 2, r.stderr
    for w in says:
        assert w in r.stderr, r.stderr
    assert "merge_check" not in r.stderr and "merge_add_input" not in r.stderr
    assert not os.path.exists(p["out"]) and not os.path.exists(rep)


# The level (bico_merge_check's, named as Transfer.check's): "options"
# opens no file, so a missing input or an input of another shape passes
# it; "inputs" (the default) refuses them as merge() does, naming the
# file, and writes nothing.
@pytest.mark.parametrize("case", ["missing", "shape", "output_is_input"])
def test_the_inputs_level_refuses_what_needs_the_files(tmp_path, case):
    p = _files(tmp_path)
    out = p["out"]
    if case == "missing":
        src = str(tmp_path / "missing.safetensors")
        says = [src]
    elif case == "shape":
        src = str(tmp_path / "odd.safetensors")
        st.write(src, {"l.weight": np.zeros((3, 4), np.float32)})
        says = [src, "l.weight", "[3, 4]", "[4, 3]"]
    else:
        src = p["ft"]
        out = str(tmp_path / "." / "ft.safetensors")
        says = ["output"]
    before = open(p["ft"], "rb").read()
    ins = [("tuned", src, 1.0, 1.0)]
    assert lora.merge_check(p["base"], ins, out, level="options") is None
    for call in (lambda: lora.merge_check(p["base"], ins, out),
                 lambda: lora.merge_check(p["base"], ins, out, level="inputs"),
                 lambda: lora.merge(p["base"], ins, out)):
        with pytest.raises(bico.BicoError) as e:
            call()
        for w in says:
            assert w in str(e.value)
        assert not os.path.exists(p["out"])
        assert open(p["ft"], "rb").read() == before
    with pytest.raises(bico.BicoError) as e:
        lora.merge_check(p["base"], ins, out, level="everything")
    assert "options" in str(e.value) and "inputs" in str(e.value)
