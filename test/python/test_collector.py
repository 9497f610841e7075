"""bico.torch: streamed statistics against stored activations, fused and
MultiheadAttention projections, GradFix votes, files, errors."""
import os
import subprocess

import numpy as np
import pytest
import torch
import torch.nn as nn

import bico
import bico.torch as bt
from test_binding_models import (float32_default,  # noqa: F401
                                 Tiny, batches, mse_loss, perturbed,
                                 record, stored_statistics)

BLOCK_MODS = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1",
              "mlp.fc2")


def depth_pairs(la, lb):
    """Target block j -> source block round(j (la-1)/(lb-1)), halves up."""
    return [0 if lb == 1 else int(np.floor(j * (la - 1) / (lb - 1) + 0.5))
            for j in range(lb)]


def pairing(la, lb):
    mods = {m: m for m in ("patch_embed", "norm", "head")}
    for j, i in enumerate(depth_pairs(la, lb)):
        for m in BLOCK_MODS:
            mods["blocks.%d.%s" % (j, m)] = "blocks.%d.%s" % (i, m)
    return mods


def assert_stats_equal(got, ref):
    assert set(got) == set(ref)
    for k, v in ref.items():
        v = v.numpy()
        assert got[k].shape == v.shape, k
        # float64 sums of the same float32 rows; gradients may differ in
        # the last float32 bit (autograd's accumulation order with hooks)
        assert np.allclose(got[k], v, rtol=1e-6,
                           atol=1e-6 * np.abs(v).max()), k


@pytest.mark.parametrize("norm", [nn.LayerNorm, None])
def test_streamed_statistics_equal_stored_activations(norm):
    torch.manual_seed(0)
    kw = {} if norm is None else {"norm": norm}
    a = Tiny(d=8, hidden=16, depth=2, **kw)
    b = Tiny(d=12, hidden=20, depth=3, **kw)   # wider and deeper
    data = batches(n_batches=2, size=8)
    col = bt.collect_statistics(a, b, data, mse_loss, show_progress=False)
    split = {"blocks.%d.attn.qkv" % j: 3 for j in range(3)}
    ref = stored_statistics(a, b, data, mse_loss, pairing(2, 3), split)
    assert_stats_equal(col.matrices(), ref)
    # one row per token per sample (cls token included); the head sees one
    # pooled row per sample
    assert col.statistics()["blocks.0.mlp.fc1.in_xcov"].rows == 2 * 8 * 6
    assert col.statistics()["head.in_xcov"].rows == 2 * 8
    # the fused qkv keeps one accumulator per block
    assert len(col.statistics()["blocks.2.attn.qkv.out_xcov"]) == 3


def test_collection_leaves_models_as_they_were():
    torch.manual_seed(0)
    a, b = Tiny(), Tiny(d=12, hidden=20)
    a.train()
    b.blocks[0].requires_grad_(False)
    before = {n: p.requires_grad for n, p in b.named_parameters()}
    x = batches()[0][0]
    with torch.no_grad():
        out_a = a.eval()(x)
    a.train()
    bt.collect_statistics(a, b, batches(1, 4), mse_loss, show_progress=False)
    assert a.training and all(m.training for m in a.modules())
    assert b.training  # nn.Module's default, restored
    assert {n: p.requires_grad for n, p in b.named_parameters()} == before
    assert all(p.grad is None for p in list(a.parameters()) +
               list(b.parameters()))
    assert not a._forward_hooks and not a.patch_embed._forward_hooks
    assert not a.patch_embed._backward_hooks
    with torch.no_grad():
        assert torch.equal(a.eval()(x), out_a)


# ---- nn.MultiheadAttention ----

class MhaNet(nn.Module):
    def __init__(self, d=8, heads=2, batch_first=True, twin=False):
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(6, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=batch_first)
        self.head = nn.Linear(d, 3)

    def forward(self, x, mask=None):
        h = self.inp(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        o, _ = self.attn(h, h, h, key_padding_mask=mask)
        if not self.batch_first:
            o = o.transpose(0, 1)
        return self.head((h + o).mean(1) if self.batch_first else
                         (h.transpose(0, 1) + o).mean(1))


class Twin(nn.Module):
    """MhaNet written out with explicit Linear in_proj / out_proj (plain
    hooks see them): the reference for what the collector must extract."""

    def __init__(self, net):
        super().__init__()
        m = net.attn
        d = m.embed_dim
        self.heads = m.num_heads
        self.inp = net.inp
        self.head = net.head
        self.attn = nn.Module()
        self.attn.in_proj = nn.Linear(d, 3 * d)
        self.attn.out_proj = nn.Linear(d, d)
        with torch.no_grad():
            self.attn.in_proj.weight.copy_(m.in_proj_weight)
            self.attn.in_proj.bias.copy_(m.in_proj_bias)
            self.attn.out_proj.weight.copy_(m.out_proj.weight)
            self.attn.out_proj.bias.copy_(m.out_proj.bias)

    def forward(self, x, mask=None):
        h = self.inp(x)
        b, n, d = h.shape
        hd = d // self.heads
        q, k, v = self.attn.in_proj(h).reshape(b, n, 3, self.heads, hd) \
            .permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / hd ** 0.5
        if mask is not None:
            s = s.masked_fill(mask[:, None, None, :], float("-inf"))
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        return self.head((h + self.attn.out_proj(o)).mean(1))


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_projections_are_collected(batch_first,
                                                      tmp_path):
    torch.manual_seed(0)
    a = MhaNet(8, 2, batch_first)
    b = MhaNet(12, 3, batch_first)
    x = torch.randn(5, 7, 6)
    mask = torch.zeros(5, 7, dtype=torch.bool)
    mask[1, 5:] = True                      # padding keys of one sample
    y = torch.randn(5, 3)
    step = lambda model, batch: mse_loss(model(batch[0], batch[1]), batch[2])
    col = bt.Collector(a, b)
    assert "attn.out_proj" not in [s.name_b for s in col.sites]
    col.collect([(x, mask, y)], step=step, show_progress=False)
    ta, tb = Twin(a), Twin(b)
    with torch.no_grad():  # the twin computes the same function
        assert torch.allclose(ta(x, mask), a(x, mask), atol=1e-5)
    # stored_statistics calls model(x): wrap the masked call
    ref = stored_statistics(
        _Call(ta, mask), _Call(tb, mask), [(x, y)], mse_loss,
        {m: m for m in ("net.inp", "net.attn.in_proj", "net.attn.out_proj",
                        "net.head")}, {"net.attn.in_proj": 3})
    ref = {k[4:]: v for k, v in ref.items()}
    assert_stats_equal(col.matrices(), ref)
    assert "forward" not in b.attn.__dict__   # the original forward is back
    with pytest.raises(bico.BicoError) as e:
        bt.Collector(a, b, modules=["attn.out_proj"])
    assert "MultiheadAttention" in e.value.message
    # the file and the transfer treat "attn.in_proj" as a fused linear
    a_ft = perturbed(a)
    new = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(), col)
    assert new["attn.in_proj_weight"].shape == (36, 12)
    assert not torch.equal(new["attn.in_proj_weight"],
                           b.state_dict()["attn.in_proj_weight"])
    # lent accumulators and the statistics file they make: the same
    path = col.save(str(tmp_path / "stats.safetensors")) or \
        str(tmp_path / "stats.safetensors")
    from_file = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(),
                                       path, split=col.split)
    for k in new:
        assert torch.allclose(new[k], from_file[k], atol=1e-5), k
    # the C driver's pool and Procrustes routes: the same answer
    for opts in (dict(workers=3), dict(proc_method="svd", workers=2),
                 dict(proc_method="polar", solve_memory=1)):
        other = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(),
                                       col, **opts)
        for k in new:
            assert torch.allclose(new[k], other[k], atol=1e-5), (opts, k)


class _Call(nn.Module):
    def __init__(self, net, mask):
        super().__init__()
        self.net = net
        self.mask = mask

    def forward(self, x):
        return self.net(x, self.mask)


# ---- files: the statistics file feeds `bico transfer --stats` ----

def bico_cli():
    build = os.environ.get("BICO_BUILD") or os.path.join(
        os.path.dirname(__file__), "..", "..", "build")
    return os.path.join(build, "bin", "bico")


def test_statistics_file_is_what_bico_transfer_reads(tmp_path):
    torch.manual_seed(0)
    a, b = Tiny(), Tiny(d=12, hidden=20, depth=3)
    col = bt.collect_statistics(a, b, batches(2, 8), mse_loss,
                                path=str(tmp_path / "stats.safetensors"),
                                show_progress=False)
    back = bico.safetensors.read(str(tmp_path / "stats.safetensors"))
    mats = col.matrices()
    assert set(back) == set(mats)
    for k in mats:
        assert back[k].dtype == np.float64 and np.array_equal(back[k],
                                                              mats[k])
    a_ft = perturbed(a)
    for name, sd in (("a", a.state_dict()), ("a_ft", a_ft),
                     ("b", b.state_dict())):
        bico.safetensors.write(str(tmp_path / (name + ".safetensors")), sd)
    out = tmp_path / "b_ft.safetensors"
    r = subprocess.run([bico_cli(), "transfer", "--method", "bico",
                        "--source-base", str(tmp_path / "a.safetensors"),
                        "--source-tuned", str(tmp_path / "a_ft.safetensors"),
                        "--target-base", str(tmp_path / "b.safetensors"),
                        "--stats", str(tmp_path / "stats.safetensors"),
                        "--split", "qkv=3", "--alpha", "2",
                        "--output", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cli = bico.safetensors.read(str(out))
    py = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(), col,
                                alpha=2.0)
    for k in py:
        assert np.allclose(cli[k], py[k].numpy(), atol=1e-5), k


def test_library_reduction_of_calibration_files_and_shard_merge(tmp_path):
    """Raw activations written as calibration files and reduced by
    bico_stats_from_calib give the collector's statistics; statistics files
    of two disjoint shards merge (bico_stats_merge) into those of all."""
    torch.manual_seed(0)
    a, b = Tiny(), Tiny(d=12, hidden=20, depth=3)
    data = batches(2, 8)
    col = bt.collect_statistics(a, b, data, mse_loss, show_progress=False)
    for name, model in (("a", a), ("b", b)):
        mods = bt.default_modules(model)
        acts, grads = record(model, mods, data, mse_loss)
        calib = {}
        for m in mods:
            calib[m + ".input"] = acts[m].float().numpy()
            calib[m + ".output_grad"] = grads[m].float().numpy()
        bico.safetensors.write(str(tmp_path / (name + ".calib.safetensors")),
                               calib)
    out = bico.model.stats_from_calib(str(tmp_path / "a.calib.safetensors"),
                                      str(tmp_path / "b.calib.safetensors"),
                                      str(tmp_path / "lib.safetensors"))
    lib = bico.safetensors.read(out)
    mine = col.matrices()
    assert set(lib) == set(mine)
    for k, v in mine.items():
        w = lib[k]
        if "qkv.out" in k:  # the library keeps the off-diagonal blocks too
            bw, bv = w.shape[0] // 3, w.shape[1] // 3
            mask = np.kron(np.eye(3), np.ones((bw, bv)))
            w = w * mask
        assert np.allclose(w, v, rtol=1e-6, atol=1e-6 * np.abs(v).max()), k
    parts = []
    for i, shard in enumerate((data[:1], data[1:])):
        p = str(tmp_path / ("shard%d.safetensors" % i))
        bt.collect_statistics(a, b, shard, mse_loss, path=p,
                              show_progress=False)
        parts.append(p)
    merged = bico.safetensors.read(bico.model.stats_merge(
        parts, str(tmp_path / "merged.safetensors")))
    for k, v in mine.items():
        assert np.allclose(merged[k], v, rtol=1e-9,
                           atol=1e-9 * np.abs(v).max()), k


def test_lent_statistics_and_statistics_file_agree_on_every_method(
        tmp_path):
    """The collector's accumulators lent from memory and the statistics
    file they write give the driver the same maps."""
    torch.manual_seed(0)
    a, b = Tiny(), Tiny(d=12, hidden=20, depth=3)
    col = bt.collect_statistics(a, b, batches(2, 8), mse_loss,
                                show_progress=False)
    path = str(tmp_path / "stats.safetensors")
    col.save(path)
    a_ft = perturbed(a)
    runs = [dict(method=m, norm_map=n) for m in ("bico", "bico-in",
                                                 "bico-out")
            for n in ("act", "grad")]
    runs += [dict(method="pad"), dict(method="bico", null="drop",
                                      rank_tol=0.05, alpha=2.5)]
    for kw in runs:
        lent = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(),
                                      col, **kw)
        filed = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(),
                                       path, split=col.split, **kw)
        arrays = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(),
                                        col.matrices(), split=col.split, **kw)
        for k in lent:
            assert lent[k].dtype == filed[k].dtype
            assert torch.allclose(lent[k], filed[k], atol=1e-5), (kw, k)
            assert torch.allclose(arrays[k], filed[k], atol=1e-5), (kw, k)


def test_centering_and_whitening_from_lent_accumulators(tmp_path):
    """Sums and Gram matrices reach the driver only from memory: centered
    and whitened maps from the collector's accumulators equal those the
    driver computes from the raw rows of calibration files."""
    torch.manual_seed(0)
    a, b = Tiny(), Tiny(d=12, hidden=20, depth=3)
    data = batches(2, 8)
    col = bt.collect_statistics(a, b, data, mse_loss, sums=True, grams=True,
                                show_progress=False)
    paths = {}
    for name, model in (("a", a), ("b", b)):
        mods = bt.default_modules(model)
        acts, grads = record(model, mods, data, mse_loss)
        calib = {}
        for m in mods:
            calib[m + ".input"] = acts[m].float().numpy()
            calib[m + ".output_grad"] = grads[m].float().numpy()
        paths[name] = str(tmp_path / (name + ".calib.safetensors"))
        bico.safetensors.write(paths[name], calib)
    a_ft = perturbed(a)
    for name, sd in (("a", a.state_dict()), ("a_ft", a_ft),
                     ("b", b.state_dict())):
        bico.safetensors.write(str(tmp_path / (name + ".safetensors")), sd)
    plain = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(), col)
    for opts in (dict(center=1), dict(center=1, whiten=0.3)):
        got = bt.transfer_state_dict(a.state_dict(), a_ft, b.state_dict(),
                                     col, **opts)
        out = str(tmp_path / "out.safetensors")
        bico.model.transfer_files(
            str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
            out, source_tuned=str(tmp_path / "a_ft.safetensors"),
            source_calib=paths["a"], target_calib=paths["b"],
            split={"qkv": 3}, **opts)
        want = bico.safetensors.read(out)
        moved = 0
        for k in want:
            assert np.allclose(got[k].numpy(), want[k], atol=1e-5), (opts, k)
            moved += not torch.allclose(got[k], plain[k], atol=1e-4)
        assert moved > 0, opts    # the options changed the maps
    # accumulators without sums cannot be centered: the solver says so
    with pytest.raises(bico.BicoError) as e:
        bt.transfer_state_dict(
            a.state_dict(), a_ft, b.state_dict(),
            bt.collect_statistics(a, b, data, mse_loss, show_progress=False),
            center=1)
    assert e.value.status == bico.E_STATE


def test_pairing_threshold_and_allow_partial():
    """As `bico transfer`: a target that pairs with too little of the
    source is an error unless allow_partial (or min_paired) says so."""
    g = np.random.default_rng(0)
    a0 = {"enc.fc.weight": g.normal(size=(3, 3)).astype(np.float32)}
    a1 = {k: v + 1 for k, v in a0.items()}
    b0 = {"enc.fc.weight": g.normal(size=(3, 3)).astype(np.float32),
          "dec.fc.weight": g.normal(size=(3, 3)).astype(np.float32),
          "dec.out.weight": g.normal(size=(3, 3)).astype(np.float32)}
    with pytest.raises(bico.BicoError) as e:
        bico.transfer_state_dict(a0, a1, b0, method="naive")
    assert e.value.status == bico.E_NOTFOUND
    for kw in (dict(allow_partial=True), dict(min_paired=0.3)):
        out = bico.transfer_state_dict(a0, a1, b0, method="naive", **kw)
        assert np.allclose(out["enc.fc.weight"], b0["enc.fc.weight"] + 1)
        assert np.array_equal(out["dec.fc.weight"], b0["dec.fc.weight"])


# ---- GradFix ----

def test_gradfix_votes_and_masks_equal_reference(tmp_path):
    torch.manual_seed(0)
    b = Tiny()
    data = [(torch.randn(3, 5, 6), torch.randn(3, 4)) for _ in range(2)]
    votes = bt.collect_votes(b, data, mse_loss, show_progress=False)
    # reference: per-sample gradients one sample at a time, signs summed
    ref = {n: torch.zeros_like(p, dtype=torch.int64)
           for n, p in b.named_parameters()}
    for x, y in data:
        for i in range(x.shape[0]):
            b.zero_grad()
            mse_loss(b(x[i:i + 1]), y[i:i + 1]).backward()
            for n, p in b.named_parameters():
                ref[n] += torch.sign(-p.grad).long()
    b.zero_grad()
    for n in ref:
        assert np.array_equal(votes[n].counts(), ref[n].numpy()), n
        assert votes[n].samples == 6
    a, a_ft = b.state_dict(), perturbed(b)   # same shapes: source = target
    new = bt.transfer_state_dict(a, a_ft, b.state_dict(), method="gradfix",
                                 votes=votes, alpha=0.7)
    for n, p in b.state_dict().items():
        tau = a_ft[n] - a[n]
        mask = (torch.sign(tau) == torch.sign(ref[n])) & (ref[n] != 0)
        assert torch.allclose(new[n], p + 0.7 * tau * mask, atol=1e-6), n
    path = bt.save_votes(str(tmp_path / "votes.safetensors"), votes)
    back, meta = bico.safetensors.read(path, with_metadata=True)
    assert meta["bico.samples"] == "6"
    assert np.array_equal(back["head.weight"], ref["head.weight"].numpy())


def test_gradfix_mean_mode_runs_in_the_driver():
    """gradfix_mode="mean": the sign of the summed descent direction, from
    Votes made with mean=True and lent to the driver; votes that count
    signs only cannot answer it."""
    torch.manual_seed(1)
    b = Tiny()
    data = [(torch.randn(3, 5, 6), torch.randn(3, 4)) for _ in range(2)]
    votes = bt.collect_votes(b, data, mse_loss, mean=True,
                             show_progress=False)
    ref = {n: torch.zeros_like(p, dtype=torch.float64)
           for n, p in b.named_parameters()}
    for x, y in data:
        for i in range(x.shape[0]):
            b.zero_grad()
            mse_loss(b(x[i:i + 1]), y[i:i + 1]).backward()
            for n, p in b.named_parameters():
                ref[n] -= p.grad.double()
    b.zero_grad()
    a, a_ft = b.state_dict(), perturbed(b)
    new = bt.transfer_state_dict(a, a_ft, b.state_dict(), method="gradfix",
                                 votes=votes, alpha=0.7, gradfix_mode="mean")
    differs = 0
    for n, p in b.state_dict().items():
        tau = a_ft[n] - a[n]
        mask = (torch.sign(tau) == torch.sign(ref[n]).float()) & (ref[n] != 0)
        assert torch.allclose(new[n], p + 0.7 * tau * mask, atol=1e-6), n
        major = torch.sign(torch.from_numpy(votes[n].counts()))
        differs += int((torch.sign(ref[n]) != major).sum())
    assert differs > 0   # mean and majority disagree somewhere: tested
    counts = {n: v.counts() for n, v in votes.items()}
    with pytest.raises(bico.BicoError) as e:
        bt.transfer_state_dict(a, a_ft, b.state_dict(), method="gradfix",
                               votes=counts, gradfix_mode="mean")
    assert e.value.status == bico.E_STATE and "mean" in e.value.message


# ---- errors surface with the library's message ----

def test_missing_module_is_named():
    a, b = Tiny(), Tiny()
    with pytest.raises(bico.BicoError) as e:
        bt.Collector(a, b, modules=["blocks.0.mlp.fc9"])
    assert e.value.status == bico.E_NOTFOUND
    assert "blocks.0.mlp.fc9" in e.value.message


def test_missing_statistics_reported_by_the_driver():
    torch.manual_seed(0)
    a, b = Tiny(), Tiny(d=12)
    col = bt.collect_statistics(a, b, batches(1, 4), mse_loss,
                                modules=["head"], show_progress=False)
    with pytest.raises(bico.BicoError) as e:
        bt.transfer_state_dict(a.state_dict(), perturbed(a), b.state_dict(),
                               col)
    assert e.value.status == bico.E_NOTFOUND
    assert "in_xcov" in e.value.message or "out_xcov" in e.value.message


def test_row_mismatch_names_the_module():
    a, b = Tiny(tokens=5), Tiny(tokens=6)
    data = [(torch.randn(2, 5, 6), torch.randn(2, 4))]
    step = lambda m, bt_: mse_loss(
        m(bt_[0] if m is a else torch.cat([bt_[0], bt_[0][:, :1]], 1)),
        bt_[1])
    with pytest.raises(bico.BicoError) as e:
        bt.collect_statistics(a, b, data, step=step, show_progress=False)
    assert e.value.status == bico.E_SHAPE
    assert "rows" in e.value.message and "12" in e.value.message
    assert not a.patch_embed._forward_hooks  # hooks removed on failure


def test_bad_statistics_file(tmp_path):
    a = Tiny()
    p = tmp_path / "stats.safetensors"
    p.write_bytes(b"\xff" * 16)
    with pytest.raises(bico.BicoError) as e:
        bt.transfer_state_dict(a.state_dict(), perturbed(a), a.state_dict(),
                               str(p))
    assert e.value.status == bico.E_FORMAT
    assert "stats.safetensors" in e.value.message


def test_shape_mismatch_naive_transfer():
    a, b = Tiny(), Tiny(d=12)
    with pytest.raises(bico.BicoError) as e:
        bt.transfer_state_dict(a.state_dict(), perturbed(a), b.state_dict(),
                               method="naive")
    assert e.value.status == bico.E_SHAPE


def test_plain_progress_lines(capsys):
    items = list(bico.torch._common._plain(range(20), None, "calib"))
    assert items == list(range(20))
    err = capsys.readouterr().err
    assert "calib: 10/20 batches" in err and "calib: 20/20 batches" in err
