"""The benchmark's models and schedules (changing any value retrains only
the models it reaches: the cache is keyed by the whole configuration)."""

PRE = dict(epochs=4, lr=2e-3)
SOURCE = dict(width=64, depth=3, heads=4, mlp=2, seed=0, split="pre-a", **PRE)
# targets: pretrained on the other half of the training set, other seeds
TARGETS = {
    "same": dict(width=64, depth=3, heads=4, mlp=2, seed=1, split="pre-b",
                 **PRE),
    "wider": dict(width=96, depth=3, heads=4, mlp=2, seed=2, split="pre-b",
                  **PRE),
    "deeper": dict(width=96, depth=4, heads=4, mlp=2, seed=3, split="pre-b",
                   **PRE),
}
FT = dict(epochs=2, lr=1e-3, samples=8000)

# Replicates: replicate r trains every model (source and targets, their
# pretraining and their fine-tunes) again with seeds shifted by SEED_STEP * r.
# Replicate 0 is the configuration above unchanged (same cache keys).
SEED_STEP = 10


def source(rep=0):
    return dict(SOURCE, seed=SOURCE["seed"] + SEED_STEP * rep)


def target(name, rep=0):
    cfg = TARGETS[name]
    return dict(cfg, seed=cfg["seed"] + SEED_STEP * rep)


# The benchmark's default run: every task and target on the first seed,
# these tasks and targets on the others (each replicate retrains its models
# from scratch; on a shared 2-core machine everything on three seeds did not
# fit in the time the run had).
SEEDS = (0, 1, 2)
REPLICATE_TASKS = ("rot90", "remap")
REPLICATE_TARGETS = ("same", "wider")
