"""CLIP (two towers: vision_model.encoder.layers.N and
text_model.encoder.layers.N, q/k/v/out_proj, mlp.fc1/fc2, layer_norm1/2,
embeddings, visual/text projections) through `bico transfer` with no extra
flags.  A tensor-level plant: every target module is its paired source
module in other coordinates (residual permutations per tower, orthogonal
q/k/v, MLP and shared projection maps), the calibration rows moved by the
same maps, and towers of different depths on each side, so that each tower
must use its own depth map.  Expected values come from the plant."""
import json
import os

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
import planted as pl  # noqa: E402
from cli import bico  # noqa: E402

DV, DT, FV, FT, E, V, NP, NT = 24, 16, 48, 32, 12, 40, 5, 7


def depth_source(la, lb, j):
    """The depth map's source block of target block j (METHODS.md)."""
    return 0 if lb == 1 else int(np.floor(j * (la - 1) / (lb - 1) + 0.5))


def shapes(lv, lt):
    s = {"vision_model.embeddings.class_embedding": (DV,),
         "vision_model.embeddings.patch_embedding.weight": (DV, 3, 4, 4),
         "vision_model.embeddings.position_embedding.weight": (NP, DV),
         "vision_model.pre_layrnorm.weight": (DV,), "vision_model.pre_layrnorm.bias": (DV,),
         "text_model.embeddings.token_embedding.weight": (V, DT),
         "text_model.embeddings.position_embedding.weight": (NT, DT)}
    for tower, L, d, f in (("vision_model", lv, DV, FV), ("text_model", lt, DT, FT)):
        for i in range(L):
            p = f"{tower}.encoder.layers.{i}."
            for m in ("q_proj", "k_proj", "v_proj", "out_proj"):
                s[p + f"self_attn.{m}.weight"] = (d, d)
                s[p + f"self_attn.{m}.bias"] = (d,)
            for n in ("layer_norm1", "layer_norm2"):
                s[p + n + ".weight"] = (d,)
                s[p + n + ".bias"] = (d,)
            s[p + "mlp.fc1.weight"] = (f, d)
            s[p + "mlp.fc1.bias"] = (f,)
            s[p + "mlp.fc2.weight"] = (d, f)
            s[p + "mlp.fc2.bias"] = (d,)
    s["vision_model.post_layernorm.weight"] = (DV,)
    s["vision_model.post_layernorm.bias"] = (DV,)
    s["text_model.final_layer_norm.weight"] = (DT,)
    s["text_model.final_layer_norm.bias"] = (DT,)
    s["visual_projection.weight"] = (E, DV)
    s["text_projection.weight"] = (E, DT)
    s["logit_scale"] = ()
    return s


def orth(g, n):
    q, r = np.linalg.qr(g.normal(size=(n, n)))
    return q * np.sign(np.diag(r))


def perm(g, n):
    return np.eye(n)[g.permutation(n)]


def plant(g, lv_a, lt_a, lv_b, lt_b):
    """A (random), tau, and for B: per module (source module, M_out, M_in),
    the target tensors and task vectors as T(A), T(tau)."""
    sa = shapes(lv_a, lt_a)
    A = {k: g.normal(size=s) / np.sqrt(s[-1] if s else 1) for k, s in sa.items()}
    for k in A:
        if "norm" in k and k.endswith(".weight"):
            A[k] = 1 + 0.3 * g.normal(size=sa[k])
    tau = {k: 0.05 * g.normal(size=s) for k, s in sa.items()}
    Pv, Pt, Pe = perm(g, DV), perm(g, DT), orth(g, E)
    # Per target module: (source module, out map, in map); new = M @ old.
    mods = {"vision_model.embeddings.patch_embedding": ("vision_model.embeddings.patch_embedding", Pv, np.eye(48)),
            "visual_projection": ("visual_projection", Pe, Pv),
            "text_projection": ("text_projection", Pe, Pt)}
    for tower, la, lb, d, f, P in (("vision_model", lv_a, lv_b, DV, FV, Pv),
                                   ("text_model", lt_a, lt_b, DT, FT, Pt)):
        for j in range(lb):
            i = depth_source(la, lb, j)
            pa, pb = f"{tower}.encoder.layers.{i}.", f"{tower}.encoder.layers.{j}."
            Q, K, Vm, F = orth(g, d), orth(g, d), orth(g, d), perm(g, f)
            for m, mo, mi in (("self_attn.q_proj", Q, P), ("self_attn.k_proj", K, P),
                              ("self_attn.v_proj", Vm, P), ("self_attn.out_proj", P, Vm),
                              ("mlp.fc1", F, P), ("mlp.fc2", P, F)):
                mods[pb + m] = (pa + m, mo, mi)
            for n in ("layer_norm1", "layer_norm2"):
                mods[pb + n] = (pa + n, P, P)
    mods["vision_model.pre_layrnorm"] = ("vision_model.pre_layrnorm", Pv, Pv)
    mods["vision_model.post_layernorm"] = ("vision_model.post_layernorm", Pv, Pv)
    mods["text_model.final_layer_norm"] = ("text_model.final_layer_norm", Pt, Pt)

    def move(sd):
        out = {}
        for mb, (ma, mo, mi) in mods.items():
            w, b = sd[ma + ".weight"], sd.get(ma + ".bias")
            if w.ndim == 1:          # a norm: permutations move scale and bias
                out[mb + ".weight"] = mo @ w
            else:
                out[mb + ".weight"] = (mo @ w.reshape(w.shape[0], -1) @ mi.T).reshape(w.shape)
            if b is not None:
                out[mb + ".bias"] = mo @ b
        out["vision_model.embeddings.class_embedding"] = Pv @ sd["vision_model.embeddings.class_embedding"]
        for k, P in (("vision_model.embeddings.position_embedding.weight", Pv),
                     ("text_model.embeddings.token_embedding.weight", Pt),
                     ("text_model.embeddings.position_embedding.weight", Pt)):
            out[k] = sd[k] @ P.T
        out["logit_scale"] = sd["logit_scale"]
        return out

    B, tauB = move(A), move(tau)
    tauB["logit_scale"] = tau["logit_scale"]   # a scalar: no method moves it
    # Calibration: per module, source rows X, G and target rows moved.
    rows = 96
    ca, cb = {}, {}
    for mb, (ma, mo, mi) in mods.items():
        din = mi.shape[0]
        if ma + ".input" not in ca:
            ca[ma + ".input"] = g.normal(size=(rows, din))
            ca[ma + ".output_grad"] = g.normal(size=(rows, mo.shape[0]))
        cb[mb + ".input"] = ca[ma + ".input"] @ mi.T
        cb[mb + ".output_grad"] = ca[ma + ".output_grad"] @ mo.T
    return A, tau, B, tauB, ca, cb


def write(folder, sd, config):
    os.makedirs(folder, exist_ok=True)
    if config is not None:
        json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    pl.save(os.path.join(folder, "model.safetensors"),
            {k: np.asarray(v, np.float32) for k, v in sorted(sd.items())}, {"format": "pt"})


@pytest.mark.parametrize("config", [True, False])
def test_both_towers_carried_with_their_own_depth_maps(tmp_path, config):
    g = np.random.default_rng(7)
    # vision 3 -> 4 blocks (0,1,1,2), text 3 -> 2 blocks (0,2): a text tower
    # mapped by the vision tower's counts would pair text block 1 with 1.
    A, tau, B, tauB, ca, cb = plant(g, 3, 3, 4, 2)
    cfg = {"model_type": "clip", "architectures": ["CLIPModel"]} if config else None
    write(tmp_path / "A", A, cfg)
    write(tmp_path / "Aft", {k: A[k] + tau[k] for k in A}, cfg)
    write(tmp_path / "B", B, cfg)
    pl.save(str(tmp_path / "ca.safetensors"), {k: v.astype(np.float32) for k, v in sorted(ca.items())})
    pl.save(str(tmp_path / "cb.safetensors"), {k: v.astype(np.float32) for k, v in sorted(cb.items())})
    bico("transfer", "--method", "bico", "--source-base", tmp_path / "A",
         "--source-tuned", tmp_path / "Aft", "--target-base", tmp_path / "B",
         "--source-calib", tmp_path / "ca.safetensors", "--target-calib", tmp_path / "cb.safetensors",
         "--output", tmp_path / "out.safetensors", "--report", tmp_path / "rep.json", "--quiet")
    got, _, _ = pl.load(str(tmp_path / "out.safetensors"))
    ent = {e["name"]: e for e in json.load(open(tmp_path / "rep.json"))["tensors"]}
    for k, t in B.items():
        if k == "logit_scale":
            assert got[k] == np.float32(t), k    # left alone
            continue
        want = t + tauB[k]
        err = np.abs(got[k] - want).max() / np.abs(tauB[k]).max()
        assert err < 2e-3, (k, err, ent[k])
    # Pairing by tower and depth, and the ties the rules chose.
    assert ent["text_model.encoder.layers.1.mlp.fc1.weight"]["source"] == \
        "text_model.encoder.layers.2.mlp.fc1.weight"
    assert ent["vision_model.encoder.layers.2.mlp.fc1.weight"]["source"] == \
        "vision_model.encoder.layers.1.mlp.fc1.weight"
    assert ent["vision_model.embeddings.class_embedding"]["handling"] == "tied"
    assert ent["text_model.embeddings.token_embedding.weight"]["handling"] == "tied"


def test_python_pairing_follows_the_towers():
    """bico.Pairing (the Python front ends' pairing) asks the library's
    model graph, so CLIP's towers pair each by its own depth map there too:
    i(j) = round(j (L_A - 1) / (L_B - 1)) per tower, computed here."""
    from bico import Pairing

    def names(v, t):
        d = {"visual_projection.weight": (4, 4)}
        for i in range(v):
            d["vision_model.encoder.layers.%d.mlp.fc1.weight" % i] = (8, 4)
        for i in range(t):
            d["text_model.encoder.layers.%d.mlp.fc1.weight" % i] = (8, 4)
        return d

    (va, ta), (vb, tb) = (3, 3), (4, 2)
    p = Pairing(names(va, ta), names(vb, tb))
    for tower, la, lb in (("vision", va, vb), ("text", ta, tb)):
        for j in range(lb):
            i = int(j * (la - 1) / (lb - 1) + 0.5)
            got = p.source_name("%s_model.encoder.layers.%d.mlp.fc1" % (tower, j))
            assert got == "%s_model.encoder.layers.%d.mlp.fc1" % (tower, i)
    assert p.source_name("visual_projection") == "visual_projection"
