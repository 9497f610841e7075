"""One rank of test_llm_ranks.py's transfer_model runs: transfer_model on
the model folders under argv[1] ("A", "A_ft", "B", "task.txt") with the
task text's windows, alpha chosen on held-out batches, under the gloo
group torchrun's variables describe (WORLD_SIZE > 1) or in one process.
argv[2]: the output folder, or "-" for the state dict.  Writes
argv[3].<rank>: {"ret": the return value (the state dict, or the dict
of what was chosen) or {"error": the BicoError's message}, "joined":
whether a process group was joined, "size": its size}."""
import os
import sys

import torch

import bico
import bico.llm as bl
import bico.torch as bt
from bico.llm.ranks import leave


def main():
    d, dest, out = sys.argv[1:4]
    torch.set_num_threads(1)
    cal = bl.text_batches(os.path.join(d, "task.txt"), 32,
                          tokenizer=os.path.join(d, "B"), batch_size=4)
    batches = list(cal.batches) + list(cal.held_out)
    rank = int(os.environ.get("RANK", "0"))
    try:
        got = bl.transfer_model(os.path.join(d, "A"), os.path.join(d, "A_ft"),
                                os.path.join(d, "B"), batches, method="fit",
                                options=bt.FitOptions(alpha="heldout",
                                                      holdout=list(cal.held_out),
                                                      threads=1),
                                output=None if dest == "-" else dest)
    except bico.BicoError as e:
        got = {"error": e.message}
    import torch.distributed as dist
    joined = dist.is_available() and dist.is_initialized()
    torch.save({"ret": got, "joined": joined, "size":
                dist.get_world_size() if joined else 1},
               "%s.%d" % (out, rank))
    leave(0)


if __name__ == "__main__":
    main()
