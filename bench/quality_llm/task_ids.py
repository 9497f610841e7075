"""The LLM quality benchmark's task text as token ids, and its model folders,
for scripts that take files (bench/llm_adapter_rank.py).

    python3 bench/quality_llm/task_ids.py OUT/

writes OUT/task_train.npy (the task's training part: the calibration text)
and OUT/task_eval.npy (the first 300 windows of 64 bytes of the held-out
part: exactly the benchmark's evaluation windows, checked), both cut by
run.py's own functions (lm.split), and OUT/models.json: the cached folders
(BICO_LLM_CACHE, default build/quality-llm) of the pretrained source, its
full fine-tune, its LoRA fine-tune merged and the pretrained targets, by
run.py's cache keys (models
not yet trained are listed with "exists": false; nothing is trained or
written in the cache here)."""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out, exist_ok=True)
    b = run.Bench(print)
    T, n = run.DATA["ctx"], run.EVAL["windows"]
    ev = b.tte[:n * T + 1].astype(np.int64)
    w = torch.stack([torch.from_numpy(ev[i * T:(i + 1) * T + 1])
                     for i in range(n)])
    assert torch.equal(w, b.eval_task), "not the benchmark's windows"
    np.save(os.path.join(out, "task_train.npy"), b.ttr.astype(np.int64))
    np.save(os.path.join(out, "task_eval.npy"), ev)
    keys = {"source": ("pre", run.SOURCE, (run.PRE,)),
            "source-tuned": ("ft", run.SOURCE, (run.PRE, run.FT))}
    for t, spec in run.TARGETS.items():
        keys[t] = ("planted-pre", spec, (run.PRE, run.FT, run.LORA)) \
            if "planted" in spec else ("pre", spec, (run.PRE,))
    models = {}
    for name, (kind, spec, rest) in keys.items():
        d = b.path("models", "%s-%s" % (kind, run.key_of(
            b.text_key, kind, spec, *rest)))
        models[name] = {"folder": d, "spec": spec, "exists": os.path.exists(
            os.path.join(d, "model.safetensors"))}
    d = b.path("models", "lora-%s" % run.key_of(
        b.text_key, "lora", run.SOURCE, run.PRE, run.LORA), "merged")
    models["source-lora-merged"] = {
        "folder": d, "spec": run.SOURCE, "exists": os.path.exists(
            os.path.join(d, "model.safetensors"))}
    with open(os.path.join(out, "models.json"), "w") as f:
        json.dump(models, f, indent=1, sort_keys=True)
    for k, v in models.items():
        print("%-13s %s%s" % (k, v["folder"], "" if v["exists"]
                              else " (not trained yet)"))


if __name__ == "__main__":
    main()
