"""libbico's internal strict JSON reader and writer (lib/base/json.c, driven
through test/json_tool.c) against Python's json module:

- documents Python writes are read and written back by libbico, and Python
  reads back the same values (exact floats, same types, same key order);
  without floats the bytes equal Python's own compact and indented output;
- on tricky and randomly mutated inputs, libbico accepts exactly what a
  strict reading of RFC 8259 accepts (Python's json plus the checks it
  lacks: NaN literals, duplicate keys, lone surrogates, int64 range,
  nesting depth).
"""
import json
import math
import os
import random
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("BICO_BUILD", os.path.join(ROOT, "build"))
TOOL = os.path.join(BUILD, "test", "json_tool")
MAX_DEPTH = 64


@pytest.fixture(scope="module")
def tool():
    if not os.path.exists(TOOL):
        rel = os.path.relpath(BUILD, ROOT)
        subprocess.run(["make", "-C", ROOT, "BUILD=" + rel,
                        os.path.join(rel, "test", "json_tool")], check=True,
                       stdout=subprocess.DEVNULL)
    return TOOL


def run(tool, data, indent=0):
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    r = subprocess.run([tool, str(indent)], input=data, capture_output=True)
    return r.returncode, r.stdout, r.stderr.decode("utf-8", "replace")


# ---- random documents ----

def rand_string(rng):
    pools = [range(0x20, 0x7f), range(0, 0x20), range(0x80, 0x800),
             range(0x800, 0xd800), range(0xe000, 0x10000),
             range(0x10000, 0x110000)]
    out = []
    for _ in range(rng.randrange(0, 12)):
        pool = pools[rng.randrange(len(pools))]
        out.append(chr(rng.randrange(pool.start, pool.stop)))
    return "".join(out)


def rand_value(rng, depth, floats=True):
    kinds = ["int", "str", "bool", "null", "list", "dict"] + (["float"] if floats else [])
    if depth >= 6:
        kinds = [k for k in kinds if k not in ("list", "dict")]
    k = rng.choice(kinds)
    if k == "int":
        return rng.choice([0, -1, 2**63 - 1, -2**63, rng.randrange(-10**6, 10**6),
                           rng.randrange(-2**63, 2**63)])
    if k == "float":
        while True:
            bits = rng.getrandbits(64)
            x = __import__("struct").unpack("<d", bits.to_bytes(8, "little"))[0]
            if math.isfinite(x):
                return rng.choice([x, 0.5, -0.0, 1e300, 1e-300, 0.1, 2.0])
    if k == "str":
        return rand_string(rng)
    if k == "bool":
        return rng.random() < 0.5
    if k == "null":
        return None
    if k == "list":
        return [rand_value(rng, depth + 1, floats) for _ in range(rng.randrange(0, 5))]
    d = {}
    for _ in range(rng.randrange(0, 5)):
        d[rand_string(rng)] = rand_value(rng, depth + 1, floats)
    return d


def same(a, b):
    """Equal values of equal types (floats bit for bit, key order kept)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


# ---- a strict reference verdict ----

class Reject(Exception):
    pass


def strict_loads(data):
    """Python's json with the strictness it lacks; raises Reject."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Reject("utf-8")

    def pairs(p):
        keys = [k for k, _ in p]
        if len(keys) != len(set(keys)):
            raise Reject("duplicate")
        return dict(p)

    def const(name):
        raise Reject(name)

    try:
        v = json.loads(text, object_pairs_hook=pairs, parse_constant=const)
    except Reject:
        raise
    except (ValueError, RecursionError):
        raise Reject("syntax")

    def walk(x, depth):
        if isinstance(x, (list, dict)):
            if depth >= MAX_DEPTH:
                raise Reject("depth")
            items = x.items() if isinstance(x, dict) else enumerate(x)
            for k, y in items:
                if isinstance(k, str):
                    walk(k, depth + 1)
                walk(y, depth + 1)
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise Reject("lone surrogate")
        elif isinstance(x, bool) or x is None:
            pass
        elif isinstance(x, int):
            if not -2**63 <= x < 2**63:
                raise Reject("int64")
        elif isinstance(x, float):
            if not math.isfinite(x):
                raise Reject("range")
    walk(v, 0)
    return v


# ---- tests ----

def test_round_trip_of_random_documents(tool):
    rng = random.Random(42)
    for i in range(150):
        doc = rand_value(rng, 0)
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 1, 4]))
        for indent in (0, 2):
            rc, out, err = run(tool, text, indent)
            assert rc == 0, (text, err)
            back = json.loads(out.decode("utf-8"))
            assert same(back, doc), (text, out)


def test_bytes_equal_pythons_own_output_without_floats(tool):
    rng = random.Random(7)
    for i in range(150):
        doc = rand_value(rng, 0, floats=False)
        text = json.dumps(doc)
        rc, out, err = run(tool, text, 0)
        assert rc == 0, err
        assert out == json.dumps(doc, separators=(",", ":"),
                                 ensure_ascii=False).encode("utf-8")
        rc, out, err = run(tool, text, 2)
        assert rc == 0, err
        assert out == json.dumps(doc, indent=2, ensure_ascii=False).encode("utf-8")


TRICKY = [
    "", " ", "{}", "[]", "0", "-0", "01", "1.", ".1", "1e", "1e+", "1E-2",
    "-", "--1", "+1", "0x1", "1_0", "true", "tru", "True", "null", "nul",
    "NaN", "-Infinity", "Infinity", "[1,]", "[,1]", "[1,,2]", "{\"a\":1,}",
    "{,}", "{\"a\"}", "{\"a\":}", "{\"a\" 1}", "{1:1}", "{'a':1}", "[1 2]",
    "\"\\u0000\"", "\"\\ud800\"", "\"\\udc00\"", "\"\\ud800\\udc00\"",
    "\"\\ud800\\u0041\"", "\"\\uDBFF\\uDFFF\"", "\"\\x41\"", "\"\\u12\"",
    "\"\\u12g4\"", "\"a\tb\"", "\"a\x7fb\"", "\"\\/\"", "[\"a\" , \"b\"]",
    "9223372036854775807", "9223372036854775808", "-9223372036854775808",
    "-9223372036854775809", "1e308", "1e309", "-1e309", "2.5e-324",
    "[" * 64 + "]" * 64, "[" * 65 + "]" * 65, "{\"a\":1}{", "[]]", "\x0b[]",
    " [ 1 , 2 ] \r\n\t", "{\"a\":1,\"a\":2}", "{\"a\":1,\"b\":{\"a\":2}}",
    "[\"\xc3\xa9\"]", "/*c*/[]", "[1]//",
]


def check_agreement(tool, data):
    try:
        want = strict_loads(data)
        ok = True
    except Reject:
        ok = False
    rc, out, err = run(tool, data, 0)
    assert rc in (0, 1), (data, rc, err)
    assert (rc == 0) == ok, (data, "libbico " + ("accepts" if rc == 0 else
                                                "rejects: " + err))
    if ok:
        assert same(json.loads(out.decode("utf-8")), want), data
    else:
        assert "invalid JSON at byte" in err, err


@pytest.mark.parametrize("text", TRICKY)
def test_tricky_inputs_agree_with_strict_reading(tool, text):
    check_agreement(tool, text.encode("utf-8", "surrogatepass"))


def test_invalid_utf8_agrees(tool):
    for raw in [b'"\xc3\x28"', b'"\xc0\xaf"', b'"\xed\xa0\x80"',
                b'"\xf4\x90\x80\x80"', b'"\x80"', b'"\xe2\x82"', b'"\xff"',
                b'"\xf0\x9f\x98\x80"', b'"\xef\xbf\xbf"']:
        check_agreement(tool, raw)


def test_random_mutations_agree_with_strict_reading(tool):
    rng = random.Random(99)
    alphabet = b'{}[]",:\\ 0123456789-+.eEtrufalsn\x00\x1f\x7f\xc3\xa9u'
    for i in range(400):
        doc = rand_value(rng, 0)
        data = bytearray(json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode())
        for _ in range(rng.randrange(1, 4)):
            op = rng.randrange(3)
            pos = rng.randrange(len(data) + 1)
            if op == 0 and data:
                del data[min(pos, len(data) - 1)]
            elif op == 1:
                data[pos:pos] = bytes([rng.choice(alphabet)])
            elif data:
                data[min(pos, len(data) - 1)] = rng.choice(alphabet)
        check_agreement(tool, bytes(data))
