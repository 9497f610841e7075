#!/usr/bin/python3
"""Writes the malformed safetensors corpus into test/data/malformed/.

Each file breaks exactly one rule of the format (or of strict JSON in its
header); test/test_safetensors.cc maps every file to the message fragment
its rejection must carry.  The files are committed; rerun this script
(/usr/bin/python3 test/data/make_malformed.py) after changing it.
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "malformed")


def pack(header, data=b"", pad=True):
    """header: dict (dumped compactly) or str/bytes (used verbatim)."""
    if isinstance(header, dict):
        h = json.dumps(header, separators=(",", ":")).encode()
    elif isinstance(header, str):
        h = header.encode()
    else:
        h = header
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def f32(*vals):
    return struct.pack("<%df" % len(vals), *vals)


def ok_header(**extra):
    h = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    h.update(extra)
    return h


CASES = {}

# -- file-level structure --
CASES["truncated_short"] = b"\x10\x00\x00\x00\x00"
CASES["truncated_data"] = pack(
    {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, f32(1, 2))
CASES["header_too_long"] = struct.pack("<Q", 100_000_001) + b"{}" + b" " * 30
CASES["header_beyond_file"] = struct.pack("<Q", 1000) + b'{"a":1}' + b" " * 9
CASES["header_bad_start"] = pack("  {}")
CASES["header_trailing_garbage"] = pack(b'{}x', pad=True)

# -- offsets --
CASES["offsets_overlap"] = pack({
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
}, f32(1, 2, 3))
CASES["offsets_gap"] = pack({
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
}, f32(1, 2, 3, 4))
CASES["offsets_trailing_bytes"] = pack(ok_header(), f32(1, 2) + b"\0\0\0\0")
CASES["offsets_not_integers"] = pack(
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0.0,8]}}', f32(1, 2))
CASES["offsets_reversed"] = pack(
    {"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, f32(1, 2))

# -- tensor entries --
CASES["unknown_dtype"] = pack(
    {"a": {"dtype": "F17", "shape": [2], "data_offsets": [0, 8]}}, f32(1, 2))
CASES["unsupported_dtype"] = pack(
    {"a": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\1\2")
CASES["duplicate_name"] = pack(
    '{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
    '"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', f32(1, 2))
# The same name once plainly, once as \u escapes: equal after decoding.
CASES["duplicate_name_escaped"] = pack(
    '{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
    '"\\u0077":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', f32(1, 2))
CASES["shape_size_mismatch"] = pack(
    {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}},
    f32(1, 2, 3, 4))
CASES["shape_negative"] = pack(
    {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, f32(1, 2))
CASES["shape_overflow"] = pack(
    {"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}},
    f32(1, 2))
CASES["shape_not_array"] = pack(
    {"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, f32(1, 2))
CASES["entry_unknown_key"] = pack(
    {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "foo": 1}},
    f32(1, 2))
CASES["entry_missing_offsets"] = pack(
    {"a": {"dtype": "F32", "shape": [2]}}, f32(1, 2))
CASES["entry_not_object"] = pack({"a": [1, 2]}, b"")
CASES["name_with_nul"] = pack(
    '{"a\\u0000b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    f32(1, 2))

# -- metadata --
CASES["metadata_nonstring"] = pack(
    ok_header(__metadata__={"format": "pt", "epochs": 3}), f32(1, 2))
CASES["metadata_not_object"] = pack(
    ok_header(__metadata__=["pt"]), f32(1, 2))

# -- strict JSON --
CASES["json_trailing_comma"] = pack(
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},}', f32(1, 2))
CASES["json_trailing_comma_array"] = pack(
    '{"a":{"dtype":"F32","shape":[2,],"data_offsets":[0,8]}}', f32(1, 2))
CASES["json_bad_escape"] = pack(
    '{"a\\x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', f32(1, 2))
CASES["json_short_unicode_escape"] = pack(
    '{"a\\u12":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', f32(1, 2))
CASES["json_lone_high_surrogate"] = pack(
    '{"a\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    f32(1, 2))
CASES["json_lone_low_surrogate"] = pack(
    '{"a\\udc00":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    f32(1, 2))
CASES["json_invalid_utf8"] = pack(
    b'{"a\xc3\x28":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    f32(1, 2))
CASES["json_overlong_utf8"] = pack(
    b'{"a\xc0\xaf":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    f32(1, 2))
CASES["json_raw_control"] = pack(
    '{"a\tb":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', f32(1, 2))
CASES["json_deep_nesting"] = pack(
    '{"__metadata__":{"x":' + "[" * 100 + "]" * 100 + "}}")
CASES["json_nan"] = pack(
    '{"a":{"dtype":"F32","shape":[NaN],'
    '"data_offsets":[0,8]}}', f32(1, 2))
CASES["json_leading_zero"] = pack(
    '{"a":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}}', f32(1, 2))
CASES["json_int_overflow"] = pack(
    '{"a":{"dtype":"F32","shape":[99999999999999999999],'
    '"data_offsets":[0,8]}}', f32(1, 2))
CASES["json_unterminated"] = pack('{"a":{"dtype":"F32', b"")
CASES["json_single_quotes"] = pack("{'a':1}")
CASES["json_comment"] = pack('{/* c */}')


def main():
    os.makedirs(OUT, exist_ok=True)
    for old in os.listdir(OUT):
        if old.endswith(".safetensors"):
            os.remove(os.path.join(OUT, old))
    for name, blob in sorted(CASES.items()):
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as fh:
            fh.write(blob)
    print("wrote %d files to %s" % (len(CASES), OUT))


if __name__ == "__main__":
    main()
