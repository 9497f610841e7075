"""bico.convert: PyTorch pickles (made here with torch.save) to
safetensors, read back with libbico's reader and compared bit for bit."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

bico = pytest.importorskip("bico")
torch = pytest.importorskip("torch")
from bico import convert as bc  # noqa: E402


def header(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


class Result(object):
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run(*args):
    """bico.convert's command line, in this process (importing torch in a
    new interpreter per call would dominate the test's time)."""
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = bc.main([str(a) for a in args])
    return Result(rc, out.getvalue(), err.getvalue())


def run_module(*args):
    """python3 -m bico.convert, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "bico.convert"] +
                          [str(a) for a in args], env=dict(os.environ),
                          capture_output=True, text=True)


def sample_state_dict():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    return {"enc.weight": w,
            "dec.weight": w,                         # tied: shared storage
            "enc.weight_t": w.t(),                   # a non-contiguous view
            "half": torch.randn(5, generator=g).half(),
            "bf16": torch.randn(2, 2, generator=g).bfloat16(),
            "f64": torch.randn(3, generator=g, dtype=torch.float64),
            "steps": torch.tensor([1, -(2 ** 40)], dtype=torch.int64),
            "mask": torch.tensor([True, False]),
            "scalar": torch.tensor(2.5)}


def same(back, sd):
    assert sorted(back) == sorted(sd)
    for k, t in sd.items():
        want = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        assert back[k].shape == tuple(t.shape), k
        assert back[k].dtype == want.dtype, k
        assert np.array_equal(back[k], want), k


def test_pickle_converts_bit_exactly(tmp_path):
    sd = sample_state_dict()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    r = run_module(tmp_path / "pytorch_model.bin",
                   tmp_path / "model.safetensors")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "model.safetensors")
    out = tmp_path / "model.safetensors"
    same(bico.safetensors.read(str(out)), sd)
    h = header(out)
    assert h["__metadata__"] == {"format": "pt"}
    assert (h["half"]["dtype"], h["bf16"]["dtype"], h["f64"]["dtype"],
            h["steps"]["dtype"], h["mask"]["dtype"]) == \
        ("F16", "BF16", "F64", "I64", "BOOL")


def test_wrapped_checkpoint_and_non_tensor_entries(tmp_path):
    sd = sample_state_dict()
    torch.save({"state_dict": sd, "epoch": 3}, tmp_path / "ckpt.pt")
    out = bc.convert(tmp_path / "ckpt.pt", tmp_path)       # a folder
    assert out == str(tmp_path / "model.safetensors")
    same(bico.safetensors.read(out), sd)
    torch.save(dict(sd, step=7), tmp_path / "mixed.pt")
    r = run(tmp_path / "mixed.pt", tmp_path / "m.safetensors")
    assert r.returncode == 1 and "step" in r.stderr
    assert "--skip-non-tensors" in r.stderr
    assert not (tmp_path / "m.safetensors").exists()
    r = run("--skip-non-tensors", tmp_path / "mixed.pt",
            tmp_path / "m.safetensors")
    assert r.returncode == 0, r.stderr
    same(bico.safetensors.read(str(tmp_path / "m.safetensors")), sd)


class Evil(object):
    def __reduce__(self):
        return (os.system, ("touch %s" % os.environ["BICO_EVIL_MARK"],))


def test_pickle_with_code_is_not_run(tmp_path, monkeypatch):
    mark = tmp_path / "ran"
    monkeypatch.setenv("BICO_EVIL_MARK", str(mark))
    torch.save({"w": torch.ones(2), "x": Evil()}, tmp_path / "evil.bin")
    r = run(tmp_path / "evil.bin", tmp_path / "e.safetensors")
    assert r.returncode == 1 and "--trust-pickle" in r.stderr
    assert not mark.exists() and not (tmp_path / "e.safetensors").exists()


def test_not_a_pickle_and_bad_outputs(tmp_path):
    (tmp_path / "junk.bin").write_bytes(b"not a pickle at all")
    r = run(tmp_path / "junk.bin", tmp_path / "j.safetensors")
    assert r.returncode == 1 and "not a PyTorch checkpoint" in r.stderr
    torch.save({"w": torch.ones(2)}, tmp_path / "w.bin")
    with pytest.raises(bico.BicoError):
        bc.convert(tmp_path / "w.bin", tmp_path / "w.safetensors.index.json")
    with pytest.raises(bico.BicoError):
        bc.convert(tmp_path / "w.bin", tmp_path / "w.bin")
    torch.save([torch.ones(2)], tmp_path / "list.bin")
    with pytest.raises(bico.BicoError) as e:
        bc.convert(tmp_path / "list.bin", tmp_path / "l.safetensors")
    assert "not a state dict" in e.value.message


def test_sharded_index(tmp_path):
    sd = sample_state_dict()
    names = sorted(sd)
    parts = [names[:4], names[4:]]
    src = tmp_path / "src"
    src.mkdir()
    wmap = {}
    for i, part in enumerate(parts):
        shard = "pytorch_model-%05d-of-00002.bin" % (i + 1)
        torch.save({k: sd[k] for k in part}, src / shard)
        wmap.update({k: shard for k in part})
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 123}, "weight_map": wmap}))
    r = run(src / "pytorch_model.bin.index.json", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    idx = tmp_path / "out" / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    assert j["metadata"] == {"total_size": 123}
    assert set(j["weight_map"].values()) == {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    same(bico.safetensors.read(str(idx)), sd)
    # an index that lies about a shard's content
    wmap[names[0]] = "pytorch_model-00002-of-00002.bin"
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": wmap}))
    r = run(src / "pytorch_model.bin.index.json", tmp_path / "out2")
    assert r.returncode == 1 and names[0] in r.stderr


def test_model_folder_converts_into_a_model_folder(tmp_path):
    """A Hugging Face folder of pickles (what the library's message tells
    users to convert) becomes a folder the library reads as a model, with
    config.json and tokenizer files copied."""
    sd = sample_state_dict()
    src = tmp_path / "hf"
    src.mkdir()
    torch.save(sd, src / "pytorch_model.bin")
    (src / "config.json").write_text('{"model_type": "bert"}')
    (src / "vocab.txt").write_text("[PAD]\n")
    r = run(src, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors",
                                       "vocab.txt"]
    assert (out / "config.json").read_text() == '{"model_type": "bert"}'
    same(bico.safetensors.read(str(out / "model.safetensors")), sd)
    # the file command the library suggests, into a folder not yet made
    r = run(src / "pytorch_model.bin", tmp_path / "new" / "model.safetensors")
    assert r.returncode == 0, r.stderr
    same(bico.safetensors.read(str(tmp_path / "new" / "model.safetensors")),
         sd)
    with pytest.raises(bico.BicoError):
        bc.convert(src, tmp_path / "x.safetensors")
    with pytest.raises(bico.BicoError):
        bc.convert(tmp_path / "new", tmp_path / "o2")   # no pickles there


def test_model_folder_copies_keep_their_permission_bits(tmp_path):
    """The folder's other files keep their mode: a 0600 file stays private,
    setuid is never carried."""
    sd = sample_state_dict()
    src = tmp_path / "hf"
    src.mkdir()
    torch.save(sd, src / "pytorch_model.bin")
    (src / "config.json").write_text("{}")
    (src / "secret.json").write_text("{}")
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "secret.json", 0o600)
    os.chmod(src / "config.json", 0o640)
    os.chmod(src / "run.sh", 0o4755)
    r = run(src, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    mode = {n: os.stat(out / n).st_mode & 0o7777
            for n in ("secret.json", "config.json", "run.sh")}
    assert mode == {"secret.json": 0o600, "config.json": 0o640,
                    "run.sh": 0o755}, mode
