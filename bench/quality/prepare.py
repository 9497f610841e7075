"""Trains (or loads from the cache) every model the benchmark needs.

    python3 prepare.py [--seeds 0,1,2] [--tasks ...] [--replicate-tasks ...]
                       [--targets ...] [--replicate-targets ...]

Defaults: what run.py's defaults need (config.SEEDS; every task on the
first seed, config.SEEDS[0]; config.REPLICATE_TASKS and REPLICATE_TARGETS
on the others).
"""
import argparse
import sys
import time

import torch

import config
import vit


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default=",".join(map(str, config.SEEDS)),
                    help="comma-separated replicates (config.SEED_STEP)")
    ap.add_argument("--tasks", default=",".join(vit.TASKS))
    ap.add_argument("--replicate-tasks",
                    default=",".join(config.REPLICATE_TASKS),
                    help="the tasks of the seeds other than "
                    "config.SEEDS[0] (\"all\": all of --tasks)")
    ap.add_argument("--targets", default=",".join(config.TARGETS))
    ap.add_argument("--replicate-targets",
                    default=",".join(config.REPLICATE_TARGETS),
                    help="the targets of the seeds other than "
                    "config.SEEDS[0] (\"all\": all of --targets)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    log = lambda s: print("[%5.0fs] %s" % (time.time() - t0, s), flush=True)
    reps = [int(s) for s in args.seeds.split(",")]
    tasks = args.tasks.split(",")
    rtasks = tasks if args.replicate_tasks == "all" else [
        t for t in tasks if t in args.replicate_tasks.split(",")]
    targets = args.targets.split(",")
    rtargets = targets if args.replicate_targets == "all" else [
        t for t in targets if t in args.replicate_targets.split(",")]
    for rep in reps:
        cfgs = [config.source(rep)] + [config.target(n, rep) for n in (
            targets if rep == config.SEEDS[0] else rtargets)]
        for cfg in cfgs:
            vit.pretrained(cfg, log)
        for task in (tasks if rep == config.SEEDS[0] else rtasks):
            for cfg in cfgs:
                vit.finetuned(cfg, task, config.FT, log)
    log("all models ready")


if __name__ == "__main__":
    sys.exit(main())
