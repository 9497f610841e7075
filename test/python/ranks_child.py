"""One rank of test_llm_ranks.py's runs: the streamed fit of the folders in
argv[1] ("A", "A_ft", "B" under it) on the batches of argv[2] (torch.save'd
{"batches", "held", "kind", "ridge", "grid"}), under a gloo process group
when WORLD_SIZE > 1.  Every rank writes argv[3].<rank>: its result's
tensors, the held-out scores and windows, the fit report."""
import os
import sys

import torch
import torch.distributed as dist

from bico.llm.ranks import Ranks, leave
from bico.llm.stream.route import StreamedFit


def main():
    folder, spec, out = sys.argv[1:4]
    s = torch.load(spec)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        import datetime
        dist.init_process_group("gloo",
                                timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    ranks = Ranks(world=size > 1)
    rep = []
    with StreamedFit(os.path.join(folder, "A"), os.path.join(folder, "A_ft"),
                     os.path.join(folder, "B"), s["batches"], s["held"],
                     threads=1, budget=1 << 14, ranks=ranks) as sf:
        res = sf.fit(s["ridge"], kind=s["kind"], rank=4, report=rep)
        win = {}
        scores = sf.score(res, s["grid"], windows=win)
        store = sf.run.store
        tensors = {}
        for n, k in list(res.new.items()) + list(sf.run.carried.items()):
            tensors[n] = store.get(k).clone()
        for m, (kb, ka) in res.pairs.items():
            tensors[m + "/B"] = store.get(kb).clone()
            tensors[m + "/A"] = store.get(ka).clone()
        torch.save({"tensors": tensors, "scores": scores, "windows": win,
                    "report": rep, "rank": ranks.rank, "size": ranks.size},
                   "%s.%d" % (out, ranks.rank))
    leave(0)     # a rank of several ends without the group's teardown


if __name__ == "__main__":
    main()
