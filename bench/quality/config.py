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
