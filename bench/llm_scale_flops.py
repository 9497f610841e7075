"""The arithmetic behind docs/performance.md section 6's 8B -> 70B estimate:
floating-point operations of `bico transfer --method bico` for a
Llama/Qwen2-shaped pair, from the per-map costs of docs/methods.md
("Thin solves"), and, given a measured run, the rate it implies and the
time it projects for a larger pair.

Per target decoder layer, 16 maps: the input map of q/k/v/o/gate/up/down
and of the two norms (residual width, or the attention/intermediate width
for o and down) and the output map of each projection.  A map is thin when
the calibration rows n <= both widths:
    thin  2 n^2 (dA + dB) + 20 n^3 + 4 n dA dB
    full  2 n dA dB + 15 min(dA, dB)^2 max(dA, dB)   (statistic + solve)
Transports: a full task vector R_out^T tau R_in per weight
(2 dBo dAo dAi + 2 dBo dAi dBi), the tied embedding 2 V dA dB, a norm or
bias O(d^2); a rank-r LoRA 2 r (dAo dBo + dAi dBi) per module.

Usage: llm_scale_flops.py [--measured WALL_S --threads T --case full|lora]
"""
import argparse

QWEN05 = dict(d=896, L=24, f=4864, H=14, KV=2, hd=64, V=151936)
QWEN15 = dict(d=1536, L=28, f=8960, H=12, KV=2, hd=128, V=151936)
LLAMA8 = dict(d=4096, L=32, f=14336, H=32, KV=8, hd=128, V=128256)
LLAMA70 = dict(d=8192, L=80, f=28672, H=64, KV=8, hd=128, V=128256)


def map_flops(n, da, db):
    if n <= min(da, db):
        return 2 * n * n * (da + db) + 20 * n ** 3 + 4 * n * da * db, 1
    return 2 * n * da * db + 15 * min(da, db) ** 2 * max(da, db), 0


def projections(m):
    """(name, out, in) of one layer's seven projections."""
    q, kv = m["H"] * m["hd"], m["KV"] * m["hd"]
    return [("q", q, m["d"]), ("k", kv, m["d"]), ("v", kv, m["d"]),
            ("o", m["d"], q), ("gate", m["f"], m["d"]), ("up", m["f"], m["d"]),
            ("down", m["d"], m["f"])]


def count(a, b, n=2048, rank=16):
    maps = thin = 0
    nmaps = 0
    full_t = lora_t = 0
    pa, pb = projections(a), projections(b)
    for _ in range(b["L"]):
        for (_, ao, ai), (_, bo, bi) in zip(pa, pb):
            for da, db in ((ai, bi), (ao, bo)):
                f, t = map_flops(n, da, db)
                maps += f
                thin += t
                nmaps += 1
            full_t += 2 * bo * ao * ai + 2 * bo * ai * bi
            lora_t += 2 * rank * (ao * bo + ai * bi)
        for _ in range(2):  # input_layernorm, post_attention_layernorm
            f, t = map_flops(n, a["d"], b["d"])
            maps += f
            thin += t
            nmaps += 1
    full_t += 2 * b["V"] * a["d"] * b["d"]
    return dict(maps=maps, thin=thin, nmaps=nmaps, full=maps + full_t,
                lora=maps + lora_t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", type=float, help="wall seconds of the 0.5B -> 1.5B run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--case", choices=("full", "lora"), default="full")
    a = ap.parse_args()
    small, big = count(QWEN05, QWEN15), count(LLAMA8, LLAMA70)
    for name, c in (("0.5B -> 1.5B", small), ("8B -> 70B", big)):
        print(f"{name}: {c['nmaps']} maps ({c['thin']} thin), maps {c['maps']:.2e} flops; "
              f"full delta {c['full']:.2e}, LoRA {c['lora']:.2e}")
    if a.measured:
        rate = small[a.case] / (a.measured * a.threads)
        core_s = big[a.case] / rate
        print(f"measured {a.case}: {small[a.case]:.2e} flops in {a.measured:.0f} s on "
              f"{a.threads} threads = {rate / 1e9:.1f} GF/s per thread")
        print(f"8B -> 70B {a.case}: {big[a.case]:.2e} / {rate:.2e} = {core_s:.2e} core-s "
              f"= {core_s / 3600:.1f} core-hours")
        for ranks, cores in ((1, 16), (8, 8), (80, 8)):
            print(f"  {ranks} rank(s) x {cores} cores: {core_s / (ranks * cores) / 3600:.2f} h")


if __name__ == "__main__":
    main()
