"""Trains (or loads from the cache) every model the benchmark needs."""
import sys
import time

import torch

import config
import vit


def main():
    torch.set_num_threads(1)
    t0 = time.time()
    log = lambda s: print("[%5.0fs] %s" % (time.time() - t0, s), flush=True)
    for name, cfg in [("source", config.SOURCE)] + list(
            config.TARGETS.items()):
        vit.pretrained(cfg, log)
    for task in vit.TASKS:
        for name, cfg in [("source", config.SOURCE)] + list(
                config.TARGETS.items()):
            vit.finetuned(cfg, task, config.FT, log)
    log("all models ready")


if __name__ == "__main__":
    sys.exit(main())
