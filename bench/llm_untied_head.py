"""The streamed fit on a target with an untied head: the head fitted after
the blocks (its output change kept by token id, the rule since
2026-12-05) beside the former rule (the head carried by BiCo's input
map) and the in-memory route, its head kept by token id as well (its
rule since the same day, from the model's get_output_embeddings()) and
by its former vocabulary x vocabulary Procrustes map of gradient
statistics (the model's get_output_embeddings hidden), on the same
batches.

    python3 bench/llm_untied_head.py [WORK]

The pair is the tests' (test/e2e/llm_pair.py: byte-level decoders trained
here, A fine-tuned fully on the task text as A_full) with B's head
untied (B's embedding plus a small perturbation, float32), as
test_llm_route.py builds B_untied.  Calibration: the task text's windows
of 32 bytes, a quarter held out.  Prints the held-out next-token loss of
the target moved by alpha times each result (alpha 0: the untouched
target) and the source's own (A_full) for reference.  The former rule is
the streamed route with run.fit_head switched off before its sweeps (the
switch the route takes when the vocabularies differ)."""
import json
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "test", "e2e"))

import bico.safetensors as st  # noqa: E402
import bico.llm as bl  # noqa: E402
import bico.torch as bt  # noqa: E402
import bico.llm.stream.stats as ss  # noqa: E402
from bico.llm.stream.route import StreamedFit, lm_loss_of  # noqa: E402
import llm_pair  # noqa: E402

GRID = [0.0, 0.5, 1.0]


def make(work):
    """llm_pair's folders, A_full and B_untied under work (kept)."""
    if os.path.exists(os.path.join(work, "B_untied", "model.safetensors")):
        return
    info = llm_pair.make(work)
    text = open(os.path.join(work, "task.txt")).read()
    ft = llm_pair.bf16(llm_pair.train_full(llm_pair.CFG_A, info["sa"],
                                           llm_pair.byte_ids(text)))
    llm_pair.write_model(os.path.join(work, "A_full"), llm_pair.CFG_A, ft)
    m = bl.load_model(os.path.join(work, "B"), dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    g = torch.Generator().manual_seed(5)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 0.01 * \
        torch.randn(sd["lm_head.weight"].shape, generator=g)
    out = os.path.join(work, "B_untied")
    os.makedirs(out)
    cfg = dict(json.load(open(os.path.join(work, "B", "config.json"))),
               tie_word_embeddings=False, torch_dtype="float32")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    shutil.copy(os.path.join(work, "B", "tokenizer.json"), out)
    st.write(os.path.join(out, "model.safetensors"),
             {k: v.numpy() for k, v in sd.items()})


def streamed(work, cal, held, fit_head):
    """{alpha: held-out loss} of the streamed fit (ridge 1e-2)."""
    orig = ss.Run.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        self.fit_head = self.fit_head and fit_head
    ss.Run.__init__ = init
    try:
        with StreamedFit(*(os.path.join(work, f) for f in
                           ("A", "A_full", "B_untied")), cal, held) as sf:
            res = sf.fit(1e-2)
            return {a: lm_loss_of(v) for a, v in sf.score(res, GRID).items()}
    finally:
        ss.Run.__init__ = orig


def loss(model, held):
    tot = n = 0
    with torch.no_grad():
        for x, y in held:
            tot += float(bl.next_token_loss(model(x), y)) * y.numel()
            n += y.numel()
    return tot / n


def in_memory(work, cal, held, by_id):
    src, srt, tgt = (bl.load_model(os.path.join(work, f),
                                   dtype=torch.float32)
                     for f in ("A", "A_full", "B_untied"))
    if not by_id:   # transfer_model finds no head: BiCo's output map
        tgt.get_output_embeddings = None
    base = {k: v.clone() for k, v in tgt.state_dict().items()}
    new = bt.transfer_model(src, srt, tgt, cal, method="fit",
                            options=bt.FitOptions(alpha=1.0),
                            loss_fn=bl.next_token_loss)
    out = {}
    for a in GRID:
        tgt.load_state_dict({k: base[k] + a * (new[k].float() -
                                               base[k].float())
                             for k in base})
        out[a] = loss(tgt, held)
    return out, loss(srt, held)


def main():
    work = sys.argv[1] if len(sys.argv) > 1 else \
        os.path.join(tempfile.gettempdir(), "bico-untied-head")
    torch.set_num_threads(1)
    make(work)
    c = bl.text_batches(os.path.join(work, "task.txt"), 32,
                        tokenizer=os.path.join(work, "B"), batch_size=8,
                        holdout=0.25)
    cal, held = list(c.batches), list(c.held_out)
    rows = [("streamed, head fitted by token id", streamed(work, cal, held,
                                                           True)),
            ("streamed, head carried (former)", streamed(work, cal, held,
                                                         False))]
    mem, src = in_memory(work, cal, held, True)
    rows.append(("in-memory, head fitted by token id", mem))
    rows.append(("in-memory, head by V x V map (former)",
                 in_memory(work, cal, held, False)[0]))
    print("held-out next-token loss, %d calibration and %d held-out "
          "batches of 8 windows of 32 bytes; the tuned source (A_full): "
          "%.4f" % (len(cal), len(held), src))
    print("%-38s %s" % ("route", "".join("  alpha %-4g" % a for a in GRID)))
    for name, r in rows:
        print("%-38s %s" % (name, "".join("  %10.4f" % r[a] for a in GRID)))


if __name__ == "__main__":
    main()
