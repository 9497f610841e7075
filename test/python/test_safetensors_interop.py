"""Interoperability of libbico's safetensors files with an independent
implementation written here from the format description (json + struct +
numpy): files libbico writes are read by this reader, files this writer
produces are read by libbico (through test/st_tool.c, which prints what the
library reads).

Run by `make check` (BICO_BUILD points at the build tree), or directly:
/usr/bin/python3 -m pytest -q test/python/test_safetensors_interop.py
"""
import json
import os
import struct
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("BICO_BUILD", os.path.join(ROOT, "build"))
TOOL = os.path.join(BUILD, "test", "st_tool")

NP = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
      "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2",
      "U8": "u1", "BOOL": "?"}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4,
            "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
            "BOOL": 1}


@pytest.fixture(scope="module")
def tool():
    if not os.path.exists(TOOL):
        rel = os.path.relpath(BUILD, ROOT)
        subprocess.run(["make", "-C", ROOT, "BUILD=" + rel,
                        os.path.join(rel, "test", "st_tool")], check=True,
                       stdout=subprocess.DEVNULL)
    return TOOL


# ---- the independent implementation ----

def bf16_bits(x32):
    """float32 array -> bfloat16 bit patterns, round to nearest even."""
    u = x32.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x32)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), "duplicate key in %r" % keys
    return dict(pairs)


def reject_constant(name):
    raise ValueError("non-JSON constant " + name)


def read_st(path):
    """Parses a safetensors file strictly; returns (metadata, {name: (dtype,
    shape, array)}, header key order)."""
    with open(path, "rb") as fh:
        blob = fh.read()
    (n,) = struct.unpack("<Q", blob[:8])
    assert 8 + n <= len(blob)
    text = blob[8:8 + n]
    assert text[:1] == b"{"
    header = json.loads(text.decode("utf-8"), object_pairs_hook=no_duplicates,
                        parse_constant=reject_constant)
    order = [k for k in json.loads(text.decode("utf-8"),
                                   object_pairs_hook=lambda p: [k for k, _ in p])]
    meta = header.pop("__metadata__", {})
    assert all(isinstance(v, str) for v in meta.values())
    data = blob[8 + n:]
    spans = []
    out = {}
    for name, e in header.items():
        assert set(e) == {"dtype", "shape", "data_offsets"}, e
        b, end = e["data_offsets"]
        numel = int(np.prod(e["shape"], dtype=np.int64)) if e["shape"] else 1
        assert end - b == numel * ITEMSIZE[e["dtype"]]
        spans.append((b, end))
        raw = data[b:end]
        if e["dtype"] == "BF16":
            arr = bf16_values(np.frombuffer(raw, "<u2").copy())
        else:
            arr = np.frombuffer(raw, NP[e["dtype"]]).copy()
        out[name] = (e["dtype"], list(e["shape"]), arr.reshape(e["shape"]))
    spans.sort()
    pos = 0
    for b, end in spans:
        assert b == pos, "gap or overlap at %d" % b
        pos = end
    assert pos == len(data), "trailing bytes"
    return meta, out, [k for k in order if k != "__metadata__"], n


def write_st(path, tensors, metadata=None, pad=True):
    """Writes like the reference implementation: tensors sorted by dtype
    size (largest first) then name; header padded with spaces to 8."""
    items = sorted(tensors.items(),
                   key=lambda kv: (-ITEMSIZE[kv[1][0]], kv[0]))
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    chunks = []
    off = 0
    for name, (dtype, arr) in items:
        if dtype == "BF16":
            raw = bf16_bits(np.asarray(arr, np.float32).ravel()).tobytes()
        else:
            raw = np.ascontiguousarray(arr, NP[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(np.shape(arr)),
                        "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h + b"".join(chunks))


# ---- the st_tool text protocol ----

def hexs(s):
    return s.encode("utf-8").hex() or "-"


def unhex(h):
    return "" if h == "-" else bytes.fromhex(h).decode("utf-8")


def tool_write(tool, path, tensors, metadata):
    lines = ["M %s %s" % (hexs(k), hexs(v)) for k, v in metadata.items()]
    for name, (dtype, shape, values) in tensors.items():
        vals = " ".join(repr(float(v)) if dtype in ("F32", "F16", "BF16", "F64")
                        else str(int(v)) for v in values)
        lines.append("T %s %s %d %s : %s" % (hexs(name), dtype, len(shape),
                                            " ".join(map(str, shape)), vals))
    r = subprocess.run([tool, "write", path], input="\n".join(lines) + "\n",
                       text=True, capture_output=True)
    assert r.returncode == 0, r.stderr


def tool_dump(tool, path):
    r = subprocess.run([tool, "dump", path], text=True, capture_output=True)
    if r.returncode != 0:
        return None, r.stderr
    meta, tensors, order = {}, {}, []
    for line in r.stdout.splitlines():
        parts = line.split(" ")
        if parts[0] == "M":
            meta[unhex(parts[1])] = unhex(parts[2])
            continue
        name, dtype, ndim = unhex(parts[1]), parts[2], int(parts[3])
        shape = [int(x) for x in parts[4:4 + ndim]]
        assert parts[4 + ndim] == ":"
        vals = np.array([float(x) for x in parts[5 + ndim:]], np.float64)
        tensors[name] = (dtype, shape, vals)
        order.append(name)
    return (meta, tensors, order), r.stderr


# ---- tests ----

def test_files_written_by_libbico_read_independently(tool, tmp_path):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(64) * 10.0 ** rng.integers(-9, 5, 64)).astype(np.float32)
    special = np.array([0.0, -0.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                        65504.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25,
                        1.0 + 2.0 ** -8, np.inf, -np.inf], np.float32)
    x = np.concatenate([x, special])
    tensors = {
        "emb.weight": ("F32", [5, 15], x),
        "blocks.0.attn.qkv.weight": ("F16", [75], x),
        "blocks.0.mlp.fc1.weight": ("BF16", [3, 25], x),
        "head.bias": ("F64", [75], x.astype(np.float64)),
        "votes": ("I32", [4], [-3, 0, 7, 2**31 - 1]),
        "counts": ("U8", [3], [0, 1, 255]),
        "mask": ("BOOL", [2], [1, 0]),
        "big": ("I64", [2], [-(2**62), 2**53]),
        "empty": ("F32", [0, 4], []),
        "scalar": ("F64", [], [2.5]),
        "caf\u00e9 \u20ac\U0001F600 \"q\"\\": ("F32", [1], [1.0]),
    }
    meta = {"format": "pt", "note": "line\nbreak \"quoted\" \u00e9"}
    path = str(tmp_path / "out.safetensors")
    tool_write(tool, path, tensors, meta)
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors"]
    got_meta, got, order, hlen = read_st(path)
    assert hlen % 8 == 0
    assert got_meta == meta
    assert order == list(tensors)  # declaration order is kept
    for name, (dtype, shape, values) in tensors.items():
        gdt, gshape, arr = got[name]
        assert gdt == dtype and gshape == shape, name
        if dtype == "F16":
            want = np.asarray(values, np.float32).astype(np.float16)
            assert arr.tobytes() == want.tobytes(), name
        elif dtype == "BF16":
            want = bf16_values(bf16_bits(np.asarray(values, np.float32)))
            assert arr.ravel().tobytes() == want.tobytes(), name
        elif dtype in ("F32", "F64"):
            want = np.asarray(values, NP[dtype])
            assert arr.ravel().tobytes() == want.tobytes(), name
        else:
            assert arr.ravel().astype(np.int64).tolist() == \
                [int(v) for v in values], name


@pytest.mark.parametrize("pad", [True, False])
def test_files_written_independently_read_by_libbico(tool, tmp_path, pad):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    tensors = {
        "w32": ("F32", a),
        "w16": ("F16", a.astype(np.float16)),
        "wbf": ("BF16", a),
        "w64": ("F64", rng.standard_normal(5)),
        "i8": ("I8", np.array([-128, 5, 127], np.int8)),
        "i16": ("I16", np.array([-300, 300], np.int16)),
        "u16": ("U16", np.array([65535, 1], np.uint16)),
        "u32": ("U32", np.array([4000000000], np.uint32)),
        "u64": ("U64", np.array([2**53, 3], np.uint64)),
        "b": ("BOOL", np.array([True, False, True])),
        "zero": ("F16", np.zeros((2, 0), np.float16)),
        "\u00e9t\u00e9": ("F32", np.array([7.0], np.float32)),
    }
    meta = {"format": "pt", "source": "python \u2713"}
    path = str(tmp_path / "py.safetensors")
    write_st(path, tensors, meta, pad=pad)
    res, err = tool_dump(tool, path)
    assert res is not None, err
    got_meta, got, order = res
    assert got_meta == meta
    assert set(got) == set(tensors)
    for name, (dtype, arr) in tensors.items():
        gdt, gshape, vals = got[name]
        assert gdt == dtype and gshape == list(np.shape(arr)), name
        if dtype == "BF16":
            want = bf16_values(bf16_bits(arr.ravel())).astype(np.float64)
        else:
            want = np.asarray(arr).ravel().astype(np.float64)
        assert vals.tolist() == want.tolist(), name
    # libbico indexes tensors in header order (here: size, then name)
    _, _, header_order, _ = read_st(path)
    assert order == header_order


def test_sharded_checkpoint_from_python(tool, tmp_path):
    rng = np.random.default_rng(9)
    s1 = {"a": ("F32", rng.standard_normal(3).astype(np.float32)),
          "b": ("F16", np.array([1.5, -2.0], np.float16))}
    s2 = {"c": ("BF16", np.array([0.5, 3.0], np.float32))}
    write_st(str(tmp_path / "model-00001-of-00002.safetensors"), s1, {"format": "pt"})
    write_st(str(tmp_path / "model-00002-of-00002.safetensors"), s2, {"format": "pt"})
    wm = {"a": "model-00001-of-00002.safetensors",
          "b": "model-00001-of-00002.safetensors",
          "c": "model-00002-of-00002.safetensors"}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 20},
                                 "weight_map": wm}, indent=2))
    res, err = tool_dump(tool, str(index))
    assert res is not None, err
    meta, got, _ = res
    assert meta == {"total_size": "20"}
    assert set(got) == {"a", "b", "c"}
    assert got["a"][2].tolist() == s1["a"][1].astype(np.float64).tolist()
    assert got["b"][2].tolist() == [1.5, -2.0]
    assert got["c"][2].tolist() == [0.5, 3.0]
    # drop c from its shard's listing: the index no longer matches
    wm["d"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": wm}))
    res, err = tool_dump(tool, str(index))
    assert res is None
    assert "weight_map lists tensor 'd'" in err and str(index) in err


def test_independent_writer_mistakes_rejected(tool, tmp_path):
    path = str(tmp_path / "bad.safetensors")
    h = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h + bytes(12))
    res, err = tool_dump(tool, path)
    assert res is None
    assert "overlap" in err and "tensor 'b'" in err and path in err
