"""Transfer.check: the run's checks without the run (bico_transfer_check),
from Python: a good configuration passes at both levels and writes
nothing; an output that is an input passes the options level (no file
opened) and fails the inputs level naming it, the input untouched; an
unknown level is refused."""
import os

import numpy as np
import pytest

import bico
from bico import safetensors as st


def _models(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    paths = {}
    for name, t in (("a", w), ("aft", w + 0.1), ("b", w * 2)):
        p = str(tmp_path / (name + ".safetensors"))
        st.write(p, {"l.weight": t})
        paths[name] = p
    return paths


def _transfer(p, output):
    t = bico.Transfer()
    t.set("method", "naive")
    t.set_file("source_base", p["a"])
    t.set_file("source_tuned", p["aft"])
    t.set_file("target_base", p["b"])
    t.set_file("output", output)
    return t


def test_a_good_configuration_passes_and_writes_nothing(tmp_path):
    p = _models(tmp_path)
    out = str(tmp_path / "o.safetensors")
    t = _transfer(p, out)
    t.check("options")
    t.check()
    assert not os.path.exists(out)
    t.run()
    got = st.read(out)["l.weight"]
    a, aft, b = (st.read(p[k])["l.weight"] for k in ("a", "aft", "b"))
    np.testing.assert_allclose(got, b + (aft - a), rtol=1e-6)


def test_an_output_that_is_an_input_fails_only_with_the_inputs(tmp_path):
    p = _models(tmp_path)
    before = open(p["a"], "rb").read()
    t = _transfer(p, p["a"])
    t.check("options")  # no file opened: identity is not known yet
    with pytest.raises(bico.BicoError) as e:
        t.check("inputs")
    assert p["a"] in str(e.value) or "a.safetensors" in str(e.value)
    assert open(p["a"], "rb").read() == before


def test_an_unknown_level_is_refused(tmp_path):
    p = _models(tmp_path)
    t = _transfer(p, str(tmp_path / "o.safetensors"))
    with pytest.raises(bico.BicoError):
        t.check("everything")
