"""How much of the fit's gain a rank-r LoRA adapter keeps, with and without
the tensors a LoRA pair cannot hold (norm scales and the embedding, stored
whole through PEFT's modules_to_save).

    python3 bench/llm_adapter_rank.py                 # the planted pair
    python3 bench/llm_adapter_rank.py --source A --source-tuned A_ft \\
        --target B --text task.txt --eval eval.txt --ranks 8,16,64

Without folders it writes test/e2e/llm_pair.py's tiny pair (16 -> 32
wide, 2 -> 3 layers) with a *full* fine-tune of the source (norms and the
tied embedding move too) under build/llm-adapter-rank.  --text and --eval
take text files or .npy token ids.  The fit runs once (transfer_model,
method "fit", at its defaults: ridge 1e-2, alpha chosen on a quarter of the
calibration batches held out); each adapter is
bico.llm.save_adapter's reduced-rank regression of that dense update,
weighted by each layer's inputs in the fitted target (update_grams).
Prints the loss on the evaluation text and the share of the dense fit's
gain (zero-shot loss - loss) each keeps; docs/llm-quickstart.md has the
numbers on the LLM benchmark's models (bench/quality_llm/task_ids.py)."""
import argparse
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "test", "e2e"))


def planted(folder):
    import llm_pair as lp
    torch.set_num_threads(1)
    text, ev = lp.task_text(400, 0), lp.task_text(100, 100)
    sa = lp.bf16(lp.source(1))
    sb = lp.bf16(lp.target_of(sa, 2))
    sft = lp.bf16(lp.train_full(lp.CFG_A, sa, lp.byte_ids(text)))
    for n, cfg, sd in (("A", lp.CFG_A, sa), ("A_ft", lp.CFG_A, sft),
                       ("B", lp.CFG_B, sb)):
        lp.write_model(os.path.join(folder, n), cfg, sd)
    for n, t in (("task.txt", text), ("eval.txt", ev)):
        with open(os.path.join(folder, n), "w") as f:
            f.write(t)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source")
    p.add_argument("--source-tuned")
    p.add_argument("--target")
    p.add_argument("--text")
    p.add_argument("--eval")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--windows", type=int, default=None,
                   help="calibration windows, spread evenly over --text "
                   "(default: all)")
    p.add_argument("--eval-windows", type=int, default=None,
                   help="evaluation windows of --eval (default: all)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="calibration windows per batch (the fit holds out "
                   "a quarter of the batches to choose alpha)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0,
                   help="text_batches' seed (the order of the calibration "
                   "batches, hence which quarter the fit holds out)")
    p.add_argument("--ranks", default="2,4,8,16,64")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    import bico.llm as bl
    import bico.torch as bt
    if not a.source:
        d = os.path.join(ROOT, "build", "llm-adapter-rank")
        planted(d)
        a.source, a.source_tuned, a.target = (os.path.join(d, n) for n in
                                              ("A", "A_ft", "B"))
        a.text, a.eval = (os.path.join(d, n) for n in ("task.txt",
                                                       "eval.txt"))
    src, srt, tgt = (bl.load_model(f, dtype=torch.float32)
                     for f in (a.source, a.source_tuned, a.target))
    cal = bl.text_batches(a.text, a.window, n=a.windows, holdout=0,
                          tokenizer=a.target, batch_size=a.batch_size,
                          seed=a.seed)
    ev = bl.text_batches(a.eval, a.window, n=a.eval_windows, holdout=0,
                         tokenizer=a.target)
    print("calibration: %d windows of %d tokens in %d batches; evaluation: "
          "%d batches" % (cal.windows, a.window, len(cal.batches),
                          len(ev.batches)))
    base = {k: v.detach().clone() for k, v in tgt.state_dict().items()}
    zero = bl.lm_loss(tgt, ev.batches)
    src_gain = bl.lm_loss(src, ev.batches) - bl.lm_loss(srt, ev.batches)
    rep = []
    new = bt.transfer_model(src, srt, tgt, cal.batches, method="fit",
                            loss_fn=bl.next_token_loss, report=rep)
    for e in rep:
        if "rule" in e or "ridge" in e:
            print("fit chose: %s" % {k: v for k, v in e.items()
                                     if k in ("rule", "alpha", "ridge")})
    delta = {k: new[k].double() - base[k].double() for k in base}

    def loss_with(d):
        tgt.load_state_dict({k: (v.double() + d[k]).to(v.dtype) if k in d
                             else v for k, v in base.items()})
        out = bl.lm_loss(tgt, ev.batches)
        tgt.load_state_dict(base)
        return out
    dense = loss_with(delta)
    gain = zero - dense
    print("zero-shot %.4f, dense fit %.4f (gain %.4f; the source's own "
          "fine-tune gained %.4f)" % (zero, dense, gain, src_gain))
    for what, keep in (("without biases", lambda k: not k.endswith(
            ".bias")), ("linear weights only", lambda k: k.endswith(
            "_proj.weight"))):
        got = loss_with({k: v for k, v in delta.items() if keep(k)})
        print("dense fit, %s: %.4f (%.1f %% of the gain)"
              % (what, got, 100 * (zero - got) / gain))
    tgt.load_state_dict(new)  # each layer's inputs as the fit saw them
    grams = bl.update_grams(tgt, cal.batches, delta)
    tgt.load_state_dict(base)
    extras = ["norm", "input_layernorm", "post_attention_layernorm",
              "embed_tokens"]
    print("%-6s %-22s %-9s %s" % ("rank", "extras", "loss", "share of the "
                                  "dense fit's gain"))
    for r in [int(x) for x in a.ranks.split(",")]:
        for saves in ([], extras):
            with tempfile.TemporaryDirectory() as t:
                rep = bl.save_adapter(t, tgt, delta, r, is_delta=True,
                                      covariance=grams,
                                      modules_to_save=saves,
                                      return_effective=True)
            got = loss_with(rep["effective"])
            print("%-6d %-22s %-9.4f %5.1f %%" % (
                r, "norms + embedding" if saves else "none", got,
                100 * (zero - got) / gain if gain else float("nan")))


if __name__ == "__main__":
    main()
