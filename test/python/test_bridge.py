"""Bridge files (docs/formats.md, "Bridge files"; issue 33): `bico bridge`
keeps the maps of a pair of base models, and `bico transfer --bridge`
carries adapters and fine-tunes across it with no calibration data.  On a
pair of Llama-family folders of different widths and depths (test/e2e/
llama.py): a direct run and a run through the bridge write the same bytes
(adapters, a merged checkpoint, a full fine-tune; free-form and
structure-aware maps); the bridge's recorded fingerprints equal the ones
this file computes from the documented definition; bridges of another
model, other options or no bridge at all are refused, nothing written;
`--fingerprint full` tells what the samples miss, and a bridge edited
after it was written is refused (issue 45)."""
import hashlib
import json
import os
import struct

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
import llama  # noqa: E402
import planted as pl  # noqa: E402
from cli import bico, same_bytes  # noqa: E402

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def write_adapter(folder, cfg, sd, g, r=4):
    """A PEFT adapter on every projection of every layer of model sd."""
    os.makedirs(folder, exist_ok=True)
    t = {}
    for k, v in sd.items():
        if any(k.endswith(p + ".weight") for p in PROJ):
            mod = k[:-len(".weight")]
            dout, din = v.shape
            t["base_model.model." + mod + ".lora_A.weight"] = \
                0.1 * torch.randn(r, din, generator=g, dtype=torch.float64)
            t["base_model.model." + mod + ".lora_B.weight"] = \
                0.1 * torch.randn(dout, r, generator=g, dtype=torch.float64)
    pl.save(os.path.join(folder, "adapter_model.safetensors"),
            {k: v.numpy().astype("float32") for k, v in t.items()})
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                   "target_modules": [p.split(".")[1] for p in PROJ],
                   "bias": "none", "task_type": "CAUSAL_LM",
                   "base_model_name_or_path": "A"}, f)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A (Llama, 2 layers, width 32) and B (3 layers, width 48, other head
    width): folders, calibration files on the same token ids, a fine-tune
    of A and two adapters of A."""
    t = tmp_path_factory.mktemp("bridge")
    ca = llama.default_config()
    cb = llama.default_config(hidden_size=48, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=64,
                              num_hidden_layers=3)
    g = torch.Generator().manual_seed(33)
    A = llama.random_state(ca, g)
    B = llama.random_state(cb, g)
    ids = torch.randint(0, ca["vocab_size"], (6, 12), generator=g)
    z = torch.randn(6, 12, ca["vocab_size"], generator=g, dtype=torch.float64)
    llama.write_folder(t / "A", ca, A)
    llama.write_folder(t / "B", cb, B)
    llama.write_folder(t / "Aft", ca, {k: v + 0.05 * torch.randn(
        v.shape, generator=g, dtype=v.dtype) for k, v in A.items()})
    pl.save(str(t / "calA.safetensors"), llama.calibrate(ca, A, ids, z))
    pl.save(str(t / "calB.safetensors"), llama.calibrate(cb, B, ids, z))
    for k in (1, 2):
        write_adapter(t / ("ad%d" % k), ca, A, g)
    return t


def calib(t):
    return ["--source-calib", t / "calA.safetensors",
            "--target-calib", t / "calB.safetensors"]


def fingerprint(folder, weights="model.safetensors", full=False):
    """docs/formats.md's definition, computed here from the files (full:
    every byte of each tensor instead of the samples)."""
    hd, start = header(os.path.join(folder, weights))
    hd.pop("__metadata__", None)
    raw = open(os.path.join(folder, weights), "rb").read()[start:]
    h = hashlib.sha256(b"bico-fingerprint full 1\n" if full
                       else b"bico-fingerprint 1\n")
    for name in sorted(hd, key=lambda s: s.encode()):
        e = hd[name]
        b, end = e["data_offsets"]
        n = end - b
        h.update(b"tensor\t" + name.encode() + b"\0")
        h.update(("%s\t%d\t%s\t%d\n" % (e["dtype"], len(e["shape"]),
                                        "".join("%d," % d for d in e["shape"]),
                                        n)).encode())
        data = raw[b:end]
        if n <= 192 or full:
            h.update(data)
        else:
            mid = (n - 64) // 2
            h.update(data[:64] + data[mid:mid + 64] + data[n - 64:])
    for role in ("config.json", "tokenizer.json"):
        p = os.path.join(folder, role)
        if os.path.isfile(p):
            text = open(p, "rb").read()
            h.update(b"file\t%d\n" % len(text) + role.encode() + b"\0" + text)
    return h.hexdigest()


def bridge_digest(path):
    """docs/formats.md's digest of a bridge ("bico.bridge.sha256"),
    computed here from the file."""
    hd, start = header(path)
    desc = hd["__metadata__"]["bico.bridge.json"].encode()
    raw = open(path, "rb").read()[start:]
    h = hashlib.sha256(b"bico-bridge-digest 1\n")
    h.update(b"description\t%d\n" % len(desc) + desc)
    for m in json.loads(desc)["maps"]:
        for key in (m[0] + ":" + m[1], m[0] + ":" + m[1] + ":rank"):
            b, end = hd[key]["data_offsets"]
            h.update(b"tensor\t" + key.encode() + b"\0" +
                     b"%d\n" % (end - b) + raw[b:end])
    return h.hexdigest()


@pytest.mark.parametrize("structure", ["free", "heads"])
def test_bridge_outputs_equal_a_direct_run(pair, structure):
    t = pair
    br = t / ("A_to_B.%s.bridge" % structure)
    common = ["--structure", structure]
    bico("bridge", "--source-base", t / "A", "--target-base", t / "B",
         *calib(t), *common, "--output", br, "-q")
    desc = json.loads(header(br)[0]["__metadata__"]["bico.bridge.json"])
    assert desc["models"]["source_base"]["fingerprint"] == fingerprint(t / "A")
    assert desc["models"]["target_base"]["fingerprint"] == fingerprint(t / "B")
    bases = ["--source-base", t / "A", "--target-base", t / "B"]
    for k in (1, 2):  # adapters: the same adapter folder, byte for byte
        ad = t / ("ad%d" % k)
        d, b = t / ("d%d_%s" % (k, structure)), t / ("b%d_%s" % (k, structure))
        bico("transfer", "--method", "bico", *common, *bases, *calib(t),
             "--lora", ad, "--alpha", "1", "--output-lora", d, "-q")
        bico("transfer", "--bridge", br, *bases, "--lora", ad, "--alpha", "1",
             "--output-lora", b, "-q")
        for f in ("adapter_model.safetensors", "adapter_config.json"):
            assert same_bytes(d / f, b / f), (k, f)
    # a full fine-tune, and an adapter merged into the target: the same
    # checkpoint, byte for byte
    for src, extra in ((["--source-tuned", t / "Aft"], []),
                       (["--lora", t / "ad1"], ["--merge-into-base"])):
        d, b = t / ("dft_" + structure), t / ("bft_" + structure)
        for out in (d, b):
            if out.exists():
                for f in out.iterdir():
                    f.unlink()
        bico("transfer", "--method", "bico", *common, *bases, *calib(t),
             *src, *extra, "--alpha", "1", "--output", d, "-q")
        bico("transfer", "--bridge", br, *bases, *src, *extra, "--alpha", "1",
             "--output", b, "-q")
        assert same_bytes(d / "model.safetensors", b / "model.safetensors")
    # the bases default to the ones the bridge recorded: the same tensors
    out = t / ("implicit_" + structure)
    bico("transfer", "--bridge", br, "--lora", t / "ad2", "--alpha", "1",
         "--output-lora", out, "-q")
    assert same_bytes(out / "adapter_model.safetensors",
                      t / ("b2_" + structure) / "adapter_model.safetensors")


def test_bridge_refuses_other_models_options_and_inputs(pair):
    t = pair
    br = t / "refuse.bridge"
    bico("bridge", "--source-base", t / "A", "--target-base", t / "B",
         *calib(t), "--output", br, "-q")
    out = t / "never"
    # another target: one sampled byte (a tensor's first) changed, and a
    # config.json changed; both are told by the fingerprint
    other = t / "B_other"
    other.mkdir()
    for f in os.listdir(t / "B"):
        (other / f).write_bytes((t / "B" / f).read_bytes())
    hd, start = header(other / "model.safetensors")
    raw = bytearray((other / "model.safetensors").read_bytes())
    first = min(e["data_offsets"][0] for k, e in hd.items()
                if k != "__metadata__")
    raw[start + first] ^= 1
    (other / "model.safetensors").write_bytes(bytes(raw))
    r = bico("transfer", "--bridge", br, "--target-base", other, "--lora",
             t / "ad1", "--alpha", "1", "--output-lora", out, ok=False)
    assert r.returncode == 1 and "fingerprint" in r.stderr, r.stderr
    assert "--target-base" in r.stderr and "not the model" in r.stderr
    cfg = json.loads((t / "B" / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "model.safetensors").write_bytes(
        (t / "B" / "model.safetensors").read_bytes())
    (other / "config.json").write_text(json.dumps(cfg))
    r = bico("transfer", "--bridge", br, "--target-base", other, "--lora",
             t / "ad1", "--alpha", "1", "--output-lora", out, ok=False)
    assert r.returncode == 1 and "fingerprint" in r.stderr, r.stderr
    # an option that shapes the maps, other than the bridge's
    r = bico("transfer", "--bridge", br, "--null", "drop", "--lora",
             t / "ad1", "--alpha", "1", "--output-lora", out, ok=False)
    assert r.returncode == 1 and "null" in r.stderr, r.stderr
    # ... the same as the bridge's: accepted
    bico("transfer", "--bridge", br, "--null", "keep", "--method", "bico",
         "--lora", t / "ad1", "--alpha", "1", "--output-lora", out, "-q")
    for f in out.iterdir():
        f.unlink()
    out.rmdir()
    # statistics beside the bridge, a method without maps: usage errors
    r = bico("transfer", "--bridge", br, *calib(t), "--lora", t / "ad1",
             "--alpha", "1", "--output-lora", out, ok=False)
    assert r.returncode == 2 and "--source-calib" in r.stderr, r.stderr
    r = bico("transfer", "--bridge", br, "--method", "naive", "--lora",
             t / "ad1", "--alpha", "1", "--output-lora", out, ok=False)
    assert r.returncode == 2 and "naive" in r.stderr, r.stderr
    # a file that is no bridge
    r = bico("transfer", "--bridge", t / "calA.safetensors", "--lora",
             t / "ad1", "--alpha", "1", "--output-lora", out, ok=False)
    assert r.returncode == 1 and "not a bridge" in r.stderr, r.stderr
    assert not out.exists()
    # making one: a fine-tune or an update option does not apply
    for extra in (["--source-tuned", t / "Aft"], ["--alpha", "2"],
                  ["--report", t / "r.json"], ["--method", "gradfix"]):
        r = bico("bridge", "--source-base", t / "A", "--target-base", t / "B",
                 *calib(t), *extra, "--output", t / "x.bridge", ok=False)
        assert r.returncode == 2, (extra, r.stderr)
    assert not (t / "x.bridge").exists()


def test_bridge_through_the_python_binding(pair):
    """Transfer.bridge() and set_file("bridge", ...): the same maps."""
    from bico.transfer import Transfer
    t = pair
    br = str(t / "py.bridge")
    with Transfer() as m:
        m.set_file("source_base", str(t / "A"))
        m.set_file("target_base", str(t / "B"))
        m.set_file("source_calib", str(t / "calA.safetensors"))
        m.set_file("target_calib", str(t / "calB.safetensors"))
        m.set_file("bridge_output", br)
        m.check()
        m.bridge()
    outs = []
    for use_bridge in (False, True):
        out = str(t / ("py_%d.safetensors" % use_bridge))
        with Transfer() as x:
            x.set_file("source_base", str(t / "A"))
            x.set_file("target_base", str(t / "B"))
            x.set_file("source_tuned", str(t / "Aft"))
            if use_bridge:
                x.set_file("bridge", br)
            else:
                x.set_file("source_calib", str(t / "calA.safetensors"))
                x.set_file("target_calib", str(t / "calB.safetensors"))
            x.set_file("output", out)
            x.run()
            assert x.get("method") == 1.0  # the handle's own setting
        outs.append(out)
    assert same_bytes(outs[0], outs[1])


def test_bridge_full_fingerprint_and_digest_on_the_command_line(pair):
    """Issue 45: `--fingerprint full` tells a target changed outside the
    192 sampled bytes of a tensor, which the default (sampled) lets pass;
    a bridge whose map bytes were edited in place is refused by its digest
    ("changed after it was written"), and one whose rank is NaN by the
    range check, both naming the file and nothing written."""
    t = pair
    full, sampled = t / "full.bridge", t / "sampled.bridge"
    bico("bridge", "--source-base", t / "A", "--target-base", t / "B",
         *calib(t), "--fingerprint", "full", "--output", full, "-q")
    bico("bridge", "--source-base", t / "A", "--target-base", t / "B",
         *calib(t), "--output", sampled, "-q")
    desc = json.loads(header(full)[0]["__metadata__"]["bico.bridge.json"])
    assert desc["options"]["fingerprint"] == 2
    assert desc["models"]["target_base"]["fingerprint"] == \
        fingerprint(t / "B", full=True)
    for br in (full, sampled):  # the documented digest
        assert bridge_digest(br) == \
            header(br)[0]["__metadata__"]["bico.bridge.sha256"]
    # B with byte 100 of its largest tensor changed: outside the samples
    other = t / "B_unsampled"
    other.mkdir()
    for f in os.listdir(t / "B"):
        (other / f).write_bytes((t / "B" / f).read_bytes())
    hd, start = header(other / "model.safetensors")
    big = max((e for k, e in hd.items() if k != "__metadata__"),
              key=lambda e: e["data_offsets"][1] - e["data_offsets"][0])
    assert big["data_offsets"][1] - big["data_offsets"][0] > 400
    raw = bytearray((other / "model.safetensors").read_bytes())
    raw[start + big["data_offsets"][0] + 100] ^= 1
    (other / "model.safetensors").write_bytes(bytes(raw))
    assert fingerprint(other) == fingerprint(t / "B")  # the samples miss it
    assert fingerprint(other, full=True) != fingerprint(t / "B", full=True)
    out = t / "fp_out"
    run = ["--lora", t / "ad1", "--alpha", "1", "--output-lora", out]
    bico("transfer", "--bridge", sampled, "--target-base", other, *run, "-q")
    for f in out.iterdir():
        f.unlink()
    out.rmdir()
    r = bico("transfer", "--bridge", full, "--target-base", other, *run,
             ok=False)
    assert r.returncode == 1 and "full fingerprint" in r.stderr, r.stderr
    assert not out.exists()
    # the bridge's own bytes: a map entry edited in place, a rank made NaN
    hd, start = header(sampled)
    raw = (t / "sampled.bridge").read_bytes()
    name = next(k for k in hd if k.endswith(":in"))
    for key, value, said in (
            (name, struct.pack("<f", 0.25), "changed after it was written"),
            (name + ":rank", struct.pack("<d", float("nan")),
             "tensor %s:rank: element [0, 0] is nan, not a rank" % name)):
        bad = bytearray(raw)
        b = start + hd[key]["data_offsets"][0]
        bad[b:b + len(value)] = value
        (t / "bad.bridge").write_bytes(bytes(bad))
        r = bico("transfer", "--bridge", t / "bad.bridge", *run, ok=False)
        assert r.returncode == 1 and said in r.stderr, r.stderr
        assert "bad.bridge" in r.stderr, r.stderr
        assert not out.exists()
