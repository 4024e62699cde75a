"""ZeRO-3's per-module hooks on the host: their Python work, cut where the profiler found it, doing the same.

ZeRO-3 gathers and releases each module's parameters in hooks around its forward and backward; at 16 layers that is
~1,200 hook calls a step, and their Python is host time the device waits for (docs/performance.md, 'ZeRO-3's hooks
in the profiler').
"""
import functools


def print_rank_0_when_asked(original):
    """``partition_parameters.print_rank_0``, which its importers take by ``import *`` after this patch
    (``partitioned_param_coordinator``, ``parameter_offload``): ZeRO-3's gathers and releases call it several times
    per parameter with ``force=False``, and each call asked torch.distributed for the rank before finding there was
    nothing to print (~2,700 ``dist.get_rank`` calls a step at 16 layers, 11 % of backward's hook time in cProfile).
    It asks only when it prints."""
    from deepspeed import comm as dist

    @functools.wraps(original)
    def print_rank_0(message, debug=False, force=False):
        if (debug or force) and dist.get_rank() == 0:
            print(message)

    return print_rank_0
