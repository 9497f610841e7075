"""The teacher across two tokenizers (bico.llm.across): the next token's
first byte is the axis both vocabularies share.  Checked against
independent computations: with one tokenizer on both sides the first-byte
teacher is the proxy teacher softmax(z_B + z_A_ft - z_A) itself, summed
by first byte (computed here from the three models' logits); the
student's grouped KL is the KL of the two distributions summed by group
(numpy, float64); where the alignment says two tokens start together,
the bytes before them are the same in both tokenizations (the bytes
decoded independently of the alignment), including text cut inside a
UTF-8 character and a tokenizer that adds a leading space.  Tiny folders
of test/e2e/llm_pair.py."""
import os

import numpy as np
import pytest
import torch

import bico.llm as bl
from bico.llm import across
from bico.llm.bpe import train
from bico.llm.text import _Bytes, load_tokenizer
from bico.torch.teacher import Grouped, kl_to_teacher

HERE = os.path.dirname(os.path.abspath(__file__))
import llm_pair  # noqa: E402

torch.set_num_threads(1)

TEXT = ("naïve café: the cat sat on the mat, 日本語 — x=1; y=22;\n" * 6 +
        "the end of the text, with ümlauts and ß.\n")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("across")
    info = llm_pair.make(str(d))
    llm_pair.bpe_target(str(d))
    return d, info


def _bytes_of(tb, ids):
    return b"".join(tb[int(i)] or b"" for i in ids)


def test_token_bytes_give_the_text_back(pair):
    d, _ = pair
    bpe = train(TEXT * 3, 300, added=["<|end|>"])
    for tk in (bpe, load_tokenizer(d / "A"), load_tokenizer(d / "B_bpe")):
        tb = across.token_bytes(tk)
        t = TEXT + "tail"
        assert _bytes_of(tb, tk.encode(t)) == t.encode("utf-8")
    tb = across.token_bytes(bpe)
    assert tb[bpe.added["<|end|>"]] is None      # a special token: no bytes
    g = across.groups(tb, len(tb) + 3)
    assert g[bpe.added["<|end|>"]] == 256 and (g[-3:] == 256).all()
    assert all(g[i] == tb[i][0] for i in range(len(tb)) if tb[i])


def _rows(ids, W, n):
    return torch.stack([ids[k * W:(k + 1) * W + 1] for k in range(n)])


@pytest.mark.parametrize("b_is_bpe,cut", [(True, 0), (False, 0),
                                          (False, 3), (False, 4)])
def test_aligned_tokens_start_after_the_same_bytes(pair, b_is_bpe, cut):
    """The target's window and the source's tokens of its text, one the
    byte tokenizer (every byte a token), the other a BPE: where a pair
    says two tokens start together, the bytes before them agree; with the
    source the byte tokenizer, every position whose next token has bytes
    is paired.  A window of bytes that starts `cut` bytes into the text
    (3: inside "ï", 4: just after it) drops the cut character's piece."""
    d, _ = pair
    by, bpe = load_tokenizer(d / "A"), load_tokenizer(d / "B_bpe")
    tb_, ta_ = (bpe, by) if b_is_bpe else (by, bpe)
    bb, ba = across.token_bytes(tb_), across.token_bytes(ta_)
    raw = TEXT.encode("utf-8")
    if b_is_bpe:
        row = torch.as_tensor(bpe.encode(TEXT))[:41]
    else:                                # the byte ids of raw[cut:]
        inv = {b: i for i, b in enumerate(bb) if b is not None}
        row = torch.tensor([inv[raw[k:k + 1]] for k in
                            range(cut, cut + 61)])
    got = across.align(row.tolist(), bb, ta_, ba)
    assert got is not None
    ids_a, pairs = got
    raw_row, text_a = _bytes_of(bb, row), _bytes_of(ba, ids_a)
    # where the source's text starts in the window: after the pieces of
    # a character cut at the start (UTF-8 continuation bytes)
    s = 0
    while 0x80 <= raw_row[s] < 0xC0:
        s += 1
    assert s == (1 if cut == 3 else 0)
    assert raw_row[s:].startswith(text_a) and len(raw_row) - len(text_a) \
        - s <= 3
    assert pairs
    for t, j in pairs:
        assert j >= 1
        assert _bytes_of(bb, row[:t + 1])[s:] == _bytes_of(ba, ids_a[:j])
    if not b_is_bpe:
        return
    starts = [len(_bytes_of(bb, row[:t + 1])) for t in range(len(row) - 1)]
    assert [t for t, _ in pairs] == [t for t in range(len(row) - 1)
                                     if 0 < starts[t] < len(text_a)]


def test_a_leading_space_tokenizer_still_aligns():
    """A tokenizer that adds a space before the text (add_prefix_space):
    its first token's space is not the window's, the rest meet."""
    table = np.arange(256, dtype=np.int64)
    plain, spaced = _Bytes(table, False), _Bytes(table, True)
    tb = across.token_bytes(plain)
    row = plain.encode("abc def")[:8].tolist()
    ids_a, pairs = across.align(row, tb, spaced, tb)
    assert _bytes_of(tb, ids_a) == b" abc def"
    assert pairs == [(t, t + 2) for t in range(len(row) - 1)]


def test_the_grouped_kl_sums_the_student_by_group():
    g = torch.Generator().manual_seed(0)
    n, V, G = 7, 13, 5
    z = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    group = torch.randint(0, G, (V,), generator=g)
    logp = torch.log_softmax(torch.randn(n, G, generator=g,
                                         dtype=torch.float64), -1)
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    got = float(kl_to_teacher(z, Grouped(logp, mask, group)))
    p = np.exp(logp.numpy())
    q = np.exp(z.numpy() - z.numpy().max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    qg = np.stack([q[:, group.numpy() == c].sum(1) for c in range(G)], 1)
    kl = (p * (np.log(p) - np.log(qg))).sum(1) * mask.numpy()
    assert got == pytest.approx(kl.sum() / n, rel=1e-5)
    # one output a group: the ordinary KL of the whole distributions
    full = torch.log_softmax(torch.randn(n, V, generator=g,
                                         dtype=torch.float64), -1)
    one = Grouped(full, torch.ones(n, dtype=torch.bool), torch.arange(V))
    assert float(kl_to_teacher(z, one)) == pytest.approx(
        float(kl_to_teacher(z, full)), rel=1e-5)


def test_one_tokenizer_gives_the_proxy_teacher_by_first_byte(pair):
    """Source and target of one byte tokenizer: every position aligned,
    and the first-byte teacher is softmax(z_B + z_A_ft - z_A) with each
    id's probability under its byte."""
    d, _ = pair
    tk = load_tokenizer(d / "A")
    A = bl.load_model(d / "A", dtype=torch.float64)
    Aft = bl.load_model(d / "A_ft", dtype=torch.float64)
    B = bl.load_model(d / "B", dtype=torch.float64)
    # ASCII: no window ends inside a character (those positions wait)
    ids = torch.as_tensor(tk.encode(TEXT.encode("ascii", "ignore")
                                    .decode()))
    W = 24
    rows = _rows(ids, W, 4)
    batches = [(rows[:2, :-1], rows[:2, 1:]), (rows[2:, :-1], rows[2:, 1:])]
    t = across.build(A, Aft, tk, tk, batches, W)
    assert (t.aligned, t.positions) == (4 * W, 4 * W)
    t.complete(B, [x for x, _ in batches])
    group = across.groups(across.token_bytes(tk))
    with torch.no_grad():
        for i, (x, _) in enumerate(batches):
            z = sum(s * getattr(m(x), "logits", m(x))
                    for s, m in ((1, B), (1, Aft), (-1, A)))
            p = torch.softmax(z.double(), -1)
            want = torch.zeros(p.shape[:-1] + (257,), dtype=p.dtype)
            want.index_add_(-1, group, p)
            e = t.get(i)
            assert e.mask.all()
            assert torch.allclose(e.logp.exp().double(), want, atol=2e-5)


def _z(m, x):
    out = m(x)
    return getattr(out, "logits", out)


def _vocab(g, n, none=3):
    """n distinct byte strings of 1-4 bytes over a small alphabet (so that
    prefixes are shared), and `none` outputs without bytes."""
    seen, out = set(), []
    while len(out) < n:
        k = int(g.integers(1, 5))
        b = bytes(int(c) for c in g.choice([97, 98, 99, 200], k))
        if b not in seen:
            seen.add(b)
            out.append(b)
    return out + [None] * none


def _level_groups(tb, prefix):
    """Brute force: level len(prefix) + 1's groups, {group: [ids]}: 0 the
    output that is exactly prefix, 1 + c the outputs with prefix + c."""
    out = {}
    for i, b in enumerate(tb):
        if b is None or not b.startswith(prefix):
            continue
        out.setdefault(0 if len(b) == len(prefix) else b[len(prefix)] + 1,
                       []).append(i)
    return out


def test_path_logmass_sums_each_level_by_brute_force():
    """bico.torch.teacher.path_logmass (sorted keys, cumulative sums,
    searchsorted) against the outputs grouped one by one in Python."""
    from bico.torch.teacher import path_logmass
    g = np.random.default_rng(3)
    depth = 4
    tb = _vocab(g, 60)
    index = across.path_index(tb, depth)
    n = 9
    p = torch.softmax(torch.randn(n, len(tb), dtype=torch.float64,
                                  generator=torch.Generator().manual_seed(2))
                      * 2, -1)
    paths = [bytes(int(c) for c in g.choice([97, 98, 99, 200], depth))
             for _ in range(n)]
    base = torch.tensor([across._bases(list(pa), depth) for pa in paths])
    lm, lw = path_logmass(p.float(), base, index)
    for r, pa in enumerate(paths):
        for k in range(depth - 1):
            grp = _level_groups(tb, pa[:k + 1])
            whole = sum(float(p[r, i]) for ids in grp.values() for i in ids)
            assert int(lw[r, k]) == sum(len(v) for v in grp.values())
            if not grp:
                continue
            for c in range(257):
                m = sum(float(p[r, i]) for i in grp.get(c, []))
                if whole > 0 and m > 0:
                    assert float(lm[r, k, c].exp()) == pytest.approx(
                        m / whole, rel=1e-4)
                else:
                    assert float(lm[r, k, c].exp()) < 1e-20


def test_the_levels_add_up_to_the_kl_over_the_finer_partition():
    """Grouped with a Path: the first byte's KL plus each level's
    conditional KL weighted by the teacher's probability of its prefix is
    the KL of the teacher and the student over the partition the path
    refines (the first byte's groups, the path's group split by its next
    byte, and so on), computed here cell by cell."""
    from bico.torch.teacher import Path
    g = np.random.default_rng(5)
    depth = 3
    tb = _vocab(g, 50)
    V = len(tb)
    index = across.path_index(tb, depth)
    group = across.groups(tb)
    n = 6
    paths = [bytes(int(c) for c in g.choice([97, 98, 99, 200], depth))
             for _ in range(n)]
    base = torch.tensor([across._bases(list(pa), depth) for pa in paths])
    gen = torch.Generator().manual_seed(1)
    l1 = torch.log_softmax(torch.randn(n, 257, generator=gen,
                                       dtype=torch.float64), -1)
    ld = torch.log_softmax(torch.randn(n, depth - 1, 257, generator=gen,
                                       dtype=torch.float64), -1)
    # the teacher's levels only where the target has outputs: its groups
    # with no output get no mass (as complete() makes them)
    for r, pa in enumerate(paths):
        for k in range(depth - 1):
            grp = _level_groups(tb, pa[:k + 1])
            for c in range(257):
                if c not in grp:
                    ld[r, k, c] = -1e4
        ld[r] = torch.log_softmax(ld[r], -1)
    for r in range(n):
        for c in range(257):
            if not (group == c).any():
                l1[r, c] = -1e4
        l1[r] = torch.log_softmax(l1[r], -1)
    reach = l1.gather(-1, torch.tensor([[pa[0]] for pa in paths])).exp()
    w = [reach[:, 0]]
    for k in range(depth - 2):
        reach = reach * ld[:, k].gather(-1, torch.tensor(
            [[pa[k + 1] + 1] for pa in paths])).exp()
        w.append(reach[:, 0])
    w = torch.stack(w, -1)
    z = torch.randn(n, V, generator=gen, dtype=torch.float64) * 2
    e = Grouped(l1, torch.ones(n, dtype=torch.bool), group,
                Path(ld, w, base, index))
    got = float(kl_to_teacher(z, e))
    q = torch.softmax(z, -1).numpy()
    total = 0.0
    for r, pa in enumerate(paths):
        # each output's cell and the teacher's probability of each cell
        cell, pt = {}, {}
        for c in range(257):
            pt[(1, c)] = float(l1[r, c].exp())
        for i, b in enumerate(tb):
            cell[i] = (1, 256 if b is None else b[0])
        for k in range(depth - 1):
            prefix = pa[:k + 1]
            key = (k + 1, prefix[-1] if k == 0 else prefix[-1] + 1)
            mass = pt.pop(key)
            for c, ids in _level_groups(tb, prefix).items():
                pt[(k + 2, c)] = mass * float(ld[r, k, c].exp())
                for i in ids:
                    cell[i] = (k + 2, c)
        qs = {}
        for i in range(V):
            qs[cell[i]] = qs.get(cell[i], 0.0) + q[r, i]
        total += sum(v * (np.log(v) - np.log(qs[c]))
                     for c, v in pt.items() if v > 1e-300 and c in qs)
    assert got == pytest.approx(total / n, rel=1e-5)


def _levels_teacher(A, Aft, B, tok_a, tok_b, window):
    """The depth-3 teacher of 4 windows of 20 target tokens of TEXT's
    ASCII: (rows, the batch's entry, W, depth)."""
    text = TEXT.encode("ascii", "ignore").decode()
    ids = torch.as_tensor(tok_b.encode(text))
    W, depth = 20, 3
    rows = _rows(ids, W, 4)
    batches = [(rows[:, :-1], rows[:, 1:])]
    t = across.build(A, Aft, tok_a, tok_b, batches, window, depth=depth)
    t.complete(B, [x for x, _ in batches])
    return rows, t.get(0), W, depth


def test_the_levels_move_the_target_as_the_source_moved(pair):
    """A byte-level source pair and a BPE target: at every aligned
    position and level, the teacher is the target's own probabilities of
    the level's groups (the outputs that begin with the text's next
    bytes), each byte's group times the source pair's ratio of that byte
    read where the text has it (the output that ends at the prefix
    unmoved), normalized; its weight the teacher's probability of the
    prefix.  Computed here from the three models' outputs on the text,
    group by group."""
    d, _ = pair
    by, bpe = load_tokenizer(d / "A"), load_tokenizer(d / "B_bpe")
    A = bl.load_model(d / "A", dtype=torch.float64)
    Aft = bl.load_model(d / "A_ft", dtype=torch.float64)
    B = bl.load_model(d / "B_bpe", dtype=torch.float64)
    rows, e, W, depth = _levels_teacher(A, Aft, B, by, bpe, 64)
    tb_b, tb_a = across.token_bytes(bpe), across.token_bytes(by)
    inv = {b[0]: i for i, b in enumerate(tb_a) if b}     # byte -> id
    checked = 0
    with torch.no_grad():
        for r in range(rows.shape[0]):
            raw = _bytes_of(tb_b, rows[r])
            src = torch.as_tensor(by.encode(raw.decode()))[None]
            la = torch.log_softmax(_z(A, src)[0], -1)
            lt = torch.log_softmax(_z(Aft, src)[0], -1)
            pb = torch.softmax(_z(B, rows[r:r + 1, :-1])[0], -1)
            for tpos in range(W):
                o = len(_bytes_of(tb_b, rows[r, :tpos + 1]))
                if not e.mask[r, tpos] or o + depth > len(raw):
                    continue
                first = e.logp[r, tpos].double()
                reach = float(first[raw[o]].exp())
                for k in range(depth - 1):
                    prefix = raw[o:o + k + 1]
                    if not reach:
                        assert float(e.path.weight[r, tpos, k]) == 0
                        continue
                    grp = _level_groups(tb_b[:pb.shape[-1]], prefix)
                    # the source's ratio of the byte after the prefix,
                    # read at the byte-level source's position before it
                    pos = o + k           # predicts byte o + k + 1
                    ratio = {c: float((lt[pos, inv[c - 1]] -
                                       la[pos, inv[c - 1]]).exp())
                             if c else 1.0 for c in grp}
                    raw_m = {c: float(pb[tpos, grp[c]].sum()) * ratio[c]
                             for c in grp}
                    tot = sum(raw_m.values())
                    for c, v in raw_m.items() if reach else ():
                        assert float(e.path.logp[r, tpos, k, c].exp()) == \
                            pytest.approx(v / tot, rel=1e-3, abs=1e-6)
                    # a level of fewer than two outputs teaches nothing,
                    # nor do the levels after it
                    if sum(len(v) for v in grp.values()) < 2:
                        reach = 0.0
                    assert float(e.path.weight[r, tpos, k]) == \
                        pytest.approx(reach, rel=1e-3, abs=1e-7)
                    reach *= float(e.path.logp[r, tpos, k,
                                               raw[o + k + 1] + 1].exp())
                    checked += reach > 0
    assert checked >= 30


def test_a_bpe_source_moves_the_levels_inside_its_own_tokens(
        pair, tmp_path):
    """A BPE source pair and a target of another BPE: where the source
    starts a token at the byte a level reads, the level moves as above
    (the source's first-byte ratio there); where the byte falls inside
    the source's token that starts at sk, the source's own outputs that
    begin with the text's bytes from sk say how fine-tuning moved it:
    each byte's group of the target's level times the source pair's
    ratio of the conditional masses of that byte's group, over the
    ratio of the output that ends there (a group neither model has:
    ratio 1).  Computed here from the three models' outputs, group by
    group; both kinds of level are met."""
    d, _ = pair
    tok_a = load_tokenizer(d / "B_bpe")
    llm_pair.bpe_target(str(tmp_path), merges=40, seed=13)
    tok_b = load_tokenizer(tmp_path / "B_bpe")
    A = bl.load_model(d / "B_bpe", dtype=torch.float64)
    Aft = bl.load_model(d / "B_bpe", dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in Aft.parameters():          # a fine-tune's stand-in
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g,
                                               dtype=p.dtype))
    B = bl.load_model(tmp_path / "B_bpe", dtype=torch.float64)
    tb_a, tb_b = across.token_bytes(tok_a), across.token_bytes(tok_b)
    assert tb_a != tb_b
    rows, e, W, depth = _levels_teacher(A, Aft, B, tok_a, tok_b, 512)
    first_of = across.groups(tb_a)
    kinds = {"start": 0, "inside": 0}
    with torch.no_grad():
        for r in range(rows.shape[0]):
            raw = _bytes_of(tb_b, rows[r])
            src = tok_a.encode(raw.decode())
            at, o2 = {}, 0
            for j, i in enumerate(src):
                if j >= 1:
                    at[o2] = j
                o2 += len(tb_a[i])
            x = torch.as_tensor(src)[None]
            pa = torch.softmax(_z(A, x)[0], -1)
            pt = torch.softmax(_z(Aft, x)[0], -1)
            pb = torch.softmax(_z(B, rows[r:r + 1, :-1])[0], -1)
            for tpos in range(W):
                o = len(_bytes_of(tb_b, rows[r, :tpos + 1]))
                if not e.mask[r, tpos] or o + depth > len(raw):
                    continue
                reach = float(e.logp[r, tpos].double()[raw[o]].exp())
                for k in range(depth - 1):
                    b = o + k + 1
                    grp = _level_groups(tb_b[:pb.shape[-1]], raw[o:b])
                    if b in at:                  # the source starts there
                        pos, kind = at[b] - 1, "start"
                        m = {c: (float(pt[pos][first_of == c - 1].sum()),
                                 float(pa[pos][first_of == c - 1].sum()))
                             for c in grp if c}
                        ratio = {c: m[c][0] / m[c][1] if c else 1.0
                                 for c in grp}
                    else:                        # inside its token at sk
                        sk = max(q for q in at if o <= q < b)
                        pos, kind = at[sk] - 1, "inside"
                        sg = _level_groups(tb_a, raw[sk:b])
                        if sum(len(v) for v in sg.values()) < 2:
                            reach = 0.0          # the source says nothing
                        wt = sum(float(pt[pos, v].sum()) for v in
                                 sg.values())
                        wa = sum(float(pa[pos, v].sum()) for v in
                                 sg.values())

                        def cond(c):
                            if c not in sg:
                                return 1.0
                            return (float(pt[pos, sg[c]].sum()) / wt) / \
                                (float(pa[pos, sg[c]].sum()) / wa)
                        ratio = {c: cond(c) / cond(0) if c else 1.0
                                 for c in grp}
                    if sum(len(v) for v in grp.values()) < 2:
                        reach = 0.0
                    if reach:
                        raw_m = {c: float(pb[tpos, grp[c]].sum()) *
                                 ratio[c] for c in grp}
                        tot = sum(raw_m.values())
                        for c, v in raw_m.items():
                            assert float(e.path.logp[r, tpos, k, c]
                                         .exp()) == pytest.approx(
                                v / tot, rel=1e-3, abs=1e-6), (kind, k)
                        kinds[kind] += 1
                    assert float(e.path.weight[r, tpos, k]) == \
                        pytest.approx(reach, rel=1e-3, abs=1e-7), (kind, k)
                    if not reach:
                        continue                 # later levels: weight 0
                    reach *= float(e.path.logp[r, tpos, k,
                                               raw[b] + 1].exp())
    assert kinds["start"] >= 10 and kinds["inside"] >= 10, kinds
