#!/usr/bin/python3
"""Writes the fuzzers' seed corpora under test/fuzz/corpus/<target>/.

The seeds are built here from the formats' specifications (safetensors,
JSON, the xcov serialisation documented in lib/numeric/xcov.c), not by libbico, so
that they do not inherit its mistakes.  Valid inputs and a few classic
malformed ones; libFuzzer mutates from there.  Run: scripts/fuzz-seeds.py
"""
import json
import math
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CORPUS = os.path.join(ROOT, "test", "fuzz", "corpus")

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4,
         "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
         "BOOL": 1, "F8_E4M3": 1}


def st_bytes(tensors, metadata=None, raw_header=None, pad=True):
    """tensors: list of (name, dtype, shape, data bytes)."""
    header, buf, off = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        n = SIZES[dtype] * math.prod(shape)
        assert len(data) == n, (name, len(data), n)
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [off, off + n]}
        buf += data
        off += n
    h = raw_header if raw_header is not None else \
        json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + buf


def f32(*xs):
    return struct.pack("<%df" % len(xs), *xs)


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def safetensors_seeds():
    t = "fuzz_safetensors"
    write(t, "empty", st_bytes([]))
    write(t, "f32_2x3", st_bytes([("w", "F32", (2, 3), f32(1, -2, 3.5, 0, 1e-3, 7))]))
    mixed = [
        ("a.f64", "F64", (2,), struct.pack("<2d", 1.5, -1e300)),
        ("b.f16", "F16", (3,), struct.pack("<3H", 0x3C00, 0x7C00, 0x0001)),
        ("c.bf16", "BF16", (2,), struct.pack("<2H", 0x3F80, 0xFFC1)),
        ("d.i8", "I8", (2,), struct.pack("<2b", -128, 127)),
        ("e.i16", "I16", (1,), struct.pack("<h", -300)),
        ("f.i32", "I32", (1,), struct.pack("<i", 2**31 - 1)),
        ("g.i64", "I64", (1,), struct.pack("<q", 2**62 + 1)),
        ("h.u8", "U8", (1,), b"\xff"),
        ("i.u16", "U16", (1,), struct.pack("<H", 65535)),
        ("j.u32", "U32", (1,), struct.pack("<I", 2**32 - 1)),
        ("k.u64", "U64", (1,), struct.pack("<Q", 2**64 - 1)),
        ("l.bool", "BOOL", (2,), b"\x00\x01"),
    ]
    write(t, "all_dtypes_meta", st_bytes(mixed, metadata={"format": "pt", "note": "\u00e9\u6f22"}))
    write(t, "scalar_and_empty", st_bytes([("s", "F32", (), f32(2.0)),
                                            ("z", "F32", (0, 4), b"")]))
    write(t, "nonfinite", st_bytes([("nan", "F32", (3,), f32(float("nan"), float("inf"), -float("inf")))]))
    write(t, "escaped_name", st_bytes([], raw_header=b'{"a\\u00e9\\ud83d\\ude00\\n":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}') + f32(1))
    write(t, "f8_unsupported", st_bytes([("q", "F8_E4M3", (2,), b"\x01\x02")]))
    # Malformed: each breaks one rule of the format.
    write(t, "bad_trailing_comma", st_bytes([], raw_header=b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},}') + f32(1))
    write(t, "bad_duplicate", st_bytes([], raw_header=b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}') + f32(1, 2))
    write(t, "bad_gap", st_bytes([], raw_header=b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}') + f32(1, 2))
    write(t, "bad_header_len", struct.pack("<Q", 2**63) + b"{}")
    write(t, "bad_overflow_shape", st_bytes([], raw_header=b'{"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}'))
    write(t, "bad_trailing_data", st_bytes([("w", "F32", (1,), f32(1))]) + b"xx")


def index_seeds():
    t = "fuzz_st_index"
    sep = b"\n@@@\n"
    s0 = st_bytes([("a", "F32", (2,), f32(1, 2)), ("b", "F16", (1,), b"\x00\x3c")])
    s1 = st_bytes([("c", "F32", (1, 1), f32(3))], metadata={"format": "pt"})
    idx = {"metadata": {"total_size": 14, "format": "pt"},
           "weight_map": {"a": "s0.safetensors", "c": "s1.safetensors",
                          "b": "s0.safetensors"}}
    js = json.dumps(idx).encode()
    write(t, "two_shards", js + sep + s0 + sep + s1)
    one = {"weight_map": {"a": "s0.safetensors", "b": "s0.safetensors"}}
    write(t, "one_shard", json.dumps(one).encode() + sep + s0)
    # Malformed: a shard tensor the map does not assign; a missing shard;
    # a name with a slash; a tensor the map lists but no shard holds.
    write(t, "bad_unassigned", json.dumps({"weight_map": {"a": "s0.safetensors"}}).encode() + sep + s0)
    write(t, "bad_missing_file", json.dumps({"weight_map": {"a": "s3.safetensors"}}).encode() + sep + s0)
    write(t, "bad_slash", json.dumps({"weight_map": {"a": "../s0.safetensors"}}).encode() + sep + s0)
    write(t, "bad_absent_tensor", json.dumps({"weight_map": {"a": "s0.safetensors", "b": "s0.safetensors", "x": "s0.safetensors"}}).encode() + sep + s0)


def json_seeds():
    t = "fuzz_json"
    docs = [
        b'{}', b'[]', b'null', b'true', b'0', b'-0.0e-0', b'"x"',
        b'{"a":[1,2.5,-3e10,true,false,null,{"b":"c"}],"d":{}}',
        b'"\\u00e9\\ud83d\\ude00\\"\\\\\\/\\b\\f\\n\\r\\t"',
        '"\u00e9\u6f22\U0001F600"'.encode(),
        b'18446744073709551615', b'1e400', b'123456789012345678901234567890',
        b' \t\r\n{ "k" : [ ] } \n',
        b'[' * 40 + b']' * 40,
        # Malformed.
        b'{"a":1,}', b'[1,]', b'{"a":1,"a":2}', b'NaN', b'01', b'1.', b'.5',
        b'"\\ud800"', b'"\xc3\x28"', b'"\xed\xa0\x80"', b'"a\x01"', b"{'a':1}",
        b'[' * 2000, b'{"a" 1}', b'"\\x41"', b'[1 2]', b'tru', b'{}x',
    ]
    for i, d in enumerate(docs):
        write(t, "doc%02d" % i, d)


def xcov_bytes(d_a, d_b, rows, flags, values, version=1):
    n = d_a * d_b + (d_a + d_b if flags & 1 else 0) + \
        (d_a * d_a + d_b * d_b if flags & 2 else 0)
    vals = (list(values) * n)[:n]
    return b"BICOXCOV" + struct.pack("<IQQQI", version, d_a, d_b, rows, flags) + \
        struct.pack("<%dd" % n, *vals)


def xcov_seeds():
    t = "fuzz_xcov"
    write(t, "plain_2x3", xcov_bytes(2, 3, 10, 0, [1.0, -2.0, 0.5, 3.0, 0.0, 1e-3]))
    write(t, "sums_3x2", xcov_bytes(3, 2, 4, 1, [0.25, 1.0, -1.0, 2.0]))
    write(t, "grams_2x2", xcov_bytes(2, 2, 7, 2, [1.0, 0.0, 0.0, 1.0]))
    write(t, "all_3x3", xcov_bytes(3, 3, 5, 3, [1.0, 2.0, 3.0, -4.0, 5.5]))
    write(t, "zero_4x1", xcov_bytes(4, 1, 0, 0, [0.0]))
    write(t, "rankdef_3x3", xcov_bytes(3, 3, 2, 0, [1.0, 1.0, 1.0]))
    write(t, "huge_values", xcov_bytes(2, 2, 1, 3, [1e300, -1e300, 1e-300]))
    write(t, "bad_version", xcov_bytes(1, 1, 1, 0, [1.0], version=2))
    write(t, "bad_trailing", xcov_bytes(1, 1, 1, 0, [1.0]) + b"\0")
    write(t, "bad_nan", xcov_bytes(1, 1, 1, 0, [float("nan")]))
    write(t, "bad_dims", b"BICOXCOV" + struct.pack("<IQQQI", 1, 2**62, 2**62, 0, 0))


def calib_stats_seeds():
    t = "fuzz_calib_stats"
    rows, d = 8, 4
    mods = ["blocks.0.fc", "blocks.1.fc"]

    def f32s(n, k):
        return f32(*[((i * 7 + k * 3) % 11 - 5) / 4.0 for i in range(n)])

    cal = st_bytes([(m + s, "F32", (rows, d), f32s(rows * d, i))
                    for i, m in enumerate(mods)
                    for s in (".input", ".output_grad")])
    cal3d = st_bytes([(m + s, "F32", (2, rows // 2, d), f32s(rows * d, i + 5))
                      for i, m in enumerate(mods)
                      for s in (".input", ".output_grad")])
    eye = struct.pack("<16d", *[1.0 if i % 5 == 0 else 0.0 for i in range(16)])
    stats = st_bytes([(m + s, "F64", (d, d), eye) for m in mods
                      for s in (".in_xcov", ".out_xcov")],
                     metadata={"rows": "8"})
    stats_zero = st_bytes([(m + s, "F64", (d, d), bytes(128)) for m in mods
                           for s in (".in_xcov", ".out_xcov")])
    params = [("blocks.0.fc.weight", (d, d)), ("blocks.0.fc.bias", (d,)),
              ("blocks.1.fc.weight", (d, d)), ("blocks.1.fc.bias", (d,))]
    votes_i32 = st_bytes([(n, "I32", s, struct.pack("<%di" % math.prod(s),
                           *[(i % 5) - 2 for i in range(math.prod(s))]))
                          for n, s in params])
    votes_f32 = st_bytes([(n, "F32", s, f32(*[float((i % 3) - 1) for i in range(math.prod(s))]))
                          for n, s in params])
    write(t, "0_stats", b"\x00" + stats)
    write(t, "0_stats_zero", b"\x00" + stats_zero)
    write(t, "1_calib_target", b"\x01" + cal)
    write(t, "1_calib_target_center", b"\x09" + cal)
    write(t, "1_calib_target_whiten", b"\x11" + cal3d)
    write(t, "1_calib_target_both", b"\x19" + cal)
    write(t, "2_calib_source", b"\x02" + cal3d)
    write(t, "3_votes_i32", b"\x03" + votes_i32)
    write(t, "3_votes_f32", b"\x03" + votes_f32)
    write(t, "4_stats_from_calib", b"\x04" + cal)


def lora_seeds():
    t = "fuzz_lora"
    sep = b"\n@@@\n"
    pre = "base_model.model."
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4,
           "target_modules": ["fc", "embed"], "use_rslora": False,
           "fan_in_fan_out": False, "bias": "none", "use_dora": False,
           "task_type": "CAUSAL_LM", "rank_pattern": {"blocks.1.fc": 1},
           "alpha_pattern": {"blocks.1.fc": 8}, "modules_to_save": ["classifier"],
           "base_model_name_or_path": "tiny"}
    ts = [(pre + "blocks.0.fc.lora_A.weight", "F32", (2, 4), f32(*[0.1 * i for i in range(8)])),
          (pre + "blocks.0.fc.lora_B.weight", "F32", (3, 2), f32(*[0.2 * i - 0.5 for i in range(6)])),
          (pre + "blocks.1.fc.lora_A.weight", "F32", (1, 3), f32(1, -1, 0.5)),
          (pre + "blocks.1.fc.lora_B.weight", "F32", (3, 1), f32(2, 0, -2)),
          (pre + "embed.lora_embedding_A", "F32", (2, 5), f32(*[0.05 * i for i in range(10)])),
          (pre + "embed.lora_embedding_B", "F32", (4, 2), f32(*[0.1 * i for i in range(8)])),
          (pre + "classifier.weight", "F32", (2, 3), f32(1, 2, 3, 4, 5, 6))]
    write(t, "full", json.dumps(cfg).encode() + sep + st_bytes(ts))
    rs = dict(cfg, use_rslora=True, fan_in_fan_out=True)
    write(t, "rslora_fifo", json.dumps(rs).encode() + sep + st_bytes(ts[:2]))
    small = {"peft_type": "LORA", "r": 2, "lora_alpha": 2}
    write(t, "minimal", json.dumps(small).encode() + sep + st_bytes(ts[:2]))
    bf = [(n, "BF16", s, b"\x80\x3f" * math.prod(s)) for n, _, s, _ in ts[:2]]
    write(t, "bf16", json.dumps(small).encode() + sep + st_bytes(bf))
    # Refused: DoRA, a rank that disagrees, a lora_A without lora_B.
    write(t, "bad_dora", json.dumps(dict(small, use_dora=True)).encode() + sep + st_bytes(ts[:2]))
    write(t, "bad_rank", json.dumps(dict(small, r=3)).encode() + sep + st_bytes(ts[:2]))
    write(t, "bad_lonely_a", json.dumps(small).encode() + sep + st_bytes(ts[:1]))


if __name__ == "__main__":
    safetensors_seeds()
    index_seeds()
    json_seeds()
    xcov_seeds()
    calib_stats_seeds()
    lora_seeds()
