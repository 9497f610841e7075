"""The binding's counts go through the status form of the C counts
(bico_X_count(h, &n), issue 25): planted numbers of tensors, metadata
entries, modules and saved tensors read back whole, a NULL handle is
E_NULL, and a model whose analysis fails raises instead of listing no
modules."""
import json
import struct

import numpy as np
import pytest

bico = pytest.importorskip("bico")
bl = pytest.importorskip("bico.lora")
from bico import _lib, _status  # noqa: E402


def _st_bytes(nt, meta):
    """A safetensors file composed here (not by libbico's writer): nt
    one-element F32 tensors t0.. and the metadata entries."""
    h = {"__metadata__": meta} if meta else {}
    for i in range(nt):
        h["t%d" % i] = {"dtype": "F32", "shape": [1],
                        "data_offsets": [4 * i, 4 * i + 4]}
    text = json.dumps(h).encode()
    text += b" " * (-len(text) % 8)
    return (struct.pack("<Q", len(text)) + text +
            np.arange(nt, dtype="<f4").tobytes())


def test_file_counts_are_the_planted_ones(tmp_path):
    g = np.random.default_rng(25)
    for r in range(4):
        nt, nm = int(g.integers(0, 9)), int(g.integers(0, 5))
        meta = {"k%d" % i: "v%d" % i for i in range(nm)}
        p = tmp_path / ("f%d.safetensors" % r)
        p.write_bytes(_st_bytes(nt, meta))
        with bico.safetensors.File(str(p)) as f:
            assert sorted(f.keys()) == sorted("t%d" % i for i in range(nt))
            assert len(f) == nt
            assert f.metadata == meta


def test_model_and_adapter_counts_are_the_planted_ones():
    k = 5
    shapes = {}
    for i in range(k):
        shapes["m%d.weight" % i] = (3, 2)
        if i % 2 == 0:
            shapes["m%d.bias" % i] = (3,)
    m = bico.Model.from_shapes(shapes)
    assert [t[0] for t in m.tensors()] == list(shapes)
    assert sorted(x[0] for x in m.modules()) == ["m%d" % i for i in range(k)]
    ad = bl.Adapter()
    for i in range(3):
        ad.add_module("m%d" % i, np.ones((3, 1)), np.ones((1, 2)), 2.0)
    for i in range(2):
        ad.add_saved("h%d.weight" % i, "h%d" % i, np.zeros(4))
    assert sorted(ad.modules()) == ["m0", "m1", "m2"]
    assert sorted(ad.saved()) == ["h0.weight", "h1.weight"]


def test_count_helper_tells_a_null_handle_from_none():
    for f in (_lib.fn.stfile_count, _lib.fn.stfile_metadata_count,
              _lib.fn.model_tensor_count, _lib.fn.model_module_count,
              _lib.fn.lora_module_count, _lib.fn.lora_saved_count):
        with pytest.raises(bico.BicoError) as e:
            _status.count(f, None)
        assert e.value.status == bico.E_NULL
    empty = bico.Model()
    assert empty.tensors() == [] and empty.modules() == []


def test_failed_analysis_raises_instead_of_no_modules():
    m = bico.Model.from_shapes({"layers.0.fc.weight": (3, 2)})
    m.set_blocks("nowhere")
    with pytest.raises(bico.BicoError) as e:
        m.modules()
    assert e.value.status == bico.E_NOTFOUND
    assert "nowhere" in str(e.value)
    m.set_blocks(None)
    assert [x[0] for x in m.modules()] == ["layers.0.fc"]
