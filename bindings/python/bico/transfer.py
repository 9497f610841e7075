"""Whole-model transfer over in-memory state dicts, run by libbico's driver.

transfer_state_dict(source_base, source_tuned, target_base, stats,
                    method="bico", alpha=1.0, ...) -> (new state dict)

There is one engine: the C driver (bico_transfer, what `bico transfer`
runs), so the rules for which map carries which tensor (include/bico/
model.h, transfer.h), the tie rule for tokens and embeddings, pairing by
name and depth map, and the pairing threshold are the library's.  The
state dicts reach it as temporary safetensors files; the statistics and
GradFix votes are lent from memory (bico_transfer_set_xcov, _set_votes):
no copy, and accumulators keep the sums and Gram matrices centering and
whitening need.

Statistics are keyed by target module: "M.in_xcov" [d_in,A, d_in,B] and
"M.out_xcov" [d_out,A, d_out,B] (arrays, bico.XCov accumulators, or for a
split module a list of per-block ones), or a path to a statistics file.
nn.MultiheadAttention's "M.in_proj_weight" / "M.in_proj_bias" are the
fused linear module "M.in_proj" (split in 3 by default: q, k, v).
"""
from ._driver import transfer_via_driver
from ._enums import METHODS as _METHOD_CODES, DEFAULT_SPLIT, choose

METHODS = tuple(_METHOD_CODES)

__all__ = ["transfer_state_dict", "METHODS", "DEFAULT_SPLIT"]


def transfer_state_dict(source_base, source_tuned, target_base, stats=None,
                        method="bico", alpha=1.0, norm_map="act",
                        split=None, ties=None, votes=None,
                        gradfix_mode="majority", source_blocks=None,
                        target_blocks=None, report=None, return_delta=False,
                        allow_partial=False, **options):
    """A new target state dict: theta_B + alpha * tau_B for every tensor a
    method carries, theta_B unchanged otherwise, with target_base's names,
    shapes and dtypes.

    The rule for what comes out: each value has the kind of target_base's
    value of that name; a torch tensor gives a torch tensor (same dtype,
    same device), anything else a NumPy array (same dtype).  So a torch
    state dict gives one that load_state_dict takes, a NumPy one (e.g. from
    bico.safetensors.read) gives NumPy arrays.  With return_delta=True the
    update alone comes as a second dict, float32, of the same kinds.

    method: bico | bico-in | bico-out (needs stats), naive, pad, gradfix
    (needs votes: {target tensor: bico.Votes or int vote array};
    gradfix_mode "majority" or "mean", which needs Votes made with
    mean=True).
    options: rank_tol, null ("keep"|"drop"), center, whiten (these two
    need XCov statistics created with sums/grams), proc_method, workers,
    solve_memory, min_paired (default 0.5: fewer paired target parameters
    is an error, as with `bico transfer`); allow_partial=True is
    min_paired=0 (`--allow-partial`).
    report: a list to append one dict per target tensor to (the driver's
    JSON report entries).
    """
    choose(_METHOD_CODES, method, "transfer: method")
    if allow_partial:
        options["min_paired"] = 0
    return transfer_via_driver(
        source_base, source_tuned, target_base, stats, method=method,
        alpha=alpha, norm_map=norm_map, split=split, ties=ties, votes=votes,
        gradfix_mode=gradfix_mode, source_blocks=source_blocks,
        target_blocks=target_blocks, report=report,
        return_delta=return_delta, **options)
