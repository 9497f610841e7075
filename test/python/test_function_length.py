"""The house rule in the Python package too: no function over 150 lines of
code.  A function's lines of code are the lines of its body that hold code
(not blank, not only a comment), its docstring left out; a nested function
counts in the function that holds it (and on its own)."""
import ast
import io
import os
import textwrap
import tokenize

import pytest

bico = pytest.importorskip("bico")

PKG = os.path.dirname(bico.__file__)
LIMIT = 150


def code_lines(src):
    """The numbers of the lines of src that hold code."""
    lines = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
            tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def function_lengths(src):
    """[(name, first line, lines of code)] of every function of src."""
    code = code_lines(src)
    out = []
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        doc = set()
        if isinstance(body[0], ast.Expr) and isinstance(
                body[0].value, ast.Constant) and isinstance(
                    body[0].value.value, str):
            doc = set(range(body[0].lineno, body[0].end_lineno + 1))
            body = body[1:]
        n = 0
        if body:
            n = sum(1 for ln in range(body[0].lineno, node.end_lineno + 1)
                    if ln in code and ln not in doc)
        out.append((node.name, node.lineno, n))
    return out


def package_files():
    for dp, dns, fns in os.walk(PKG):
        dns[:] = sorted(d for d in dns if d != "__pycache__")
        for f in sorted(fns):
            if f.endswith(".py"):
                yield os.path.join(dp, f)


def test_no_function_over_150_lines_of_code():
    files = list(package_files())
    # the sub-packages are walked too
    assert any(os.sep + "torch" + os.sep in f for f in files)
    assert any(os.sep + "llm" + os.sep in f for f in files)
    long = ["%s:%d %s (%d lines)" % (os.path.relpath(f, PKG), line, name, n)
            for f in files
            for name, line, n in function_lengths(open(f).read())
            if n > LIMIT]
    assert not long, "functions over %d lines of code: %s" % (
        LIMIT, "; ".join(long))


def planted(n_code, comments=0, blanks=0, doc_lines=0):
    """A function with a docstring of doc_lines lines, then n_code lines of
    code with comment-only and blank lines among them."""
    body = []
    if doc_lines:
        body += ['"""doc'] + ["text"] * (doc_lines - 2) + ['"""']
    body += ["x%d = %d" % (i, i) for i in range(n_code)]
    body[len(body) // 2:len(body) // 2] = ["# note"] * comments + \
        [""] * blanks
    return "def f():\n" + textwrap.indent("\n".join(body), "    ") + "\n"


@pytest.mark.parametrize("n_code,comments,blanks,doc_lines,want", [
    (150, 0, 0, 0, 150), (151, 0, 0, 0, 151),
    (150, 20, 10, 0, 150),          # comments and blank lines do not count
    (150, 0, 0, 40, 150),           # nor does the docstring
    (3, 0, 0, 0, 3)])
def test_the_count_is_of_code_lines(n_code, comments, blanks, doc_lines,
                                    want):
    (name, _, n), = function_lengths(planted(n_code, comments, blanks,
                                             doc_lines))
    assert name == "f" and n == want


def test_a_long_nested_function_counts_in_its_holder():
    src = "def outer():\n" + textwrap.indent(planted(151), "    ") + \
        "    return f\n"
    got = {name: n for name, _, n in function_lengths(src)}
    assert got == {"outer": 153, "f": 151}
    # a statement spread over lines counts each line
    src = "def g():\n    y = (1 +\n         2)\n    return y\n"
    assert function_lengths(src)[0][2] == 3
