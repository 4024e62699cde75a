"""ZeRO-3's per-module hooks on the host: their Python work, cut where the profiler found it, doing the same; and
what they release before the parameter order is recorded, so that a resumed job's first step runs the uninterrupted
job's graph.

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


_PERSISTENT_HOLD = "deepspeed_xla: persistent"  # held in ds_active_sub_modules (module ids) while a module releases


def persistent_parameters_stay_gathered(original):
    """``PartitionedParameterCoordinator.release_sub_module`` before the parameter order is recorded (a job's first
    step, after a resume too, or after the order changed): persistent parameters stay gathered, as they do once it is
    recorded. Upstream releases them after each module there and gathers them again for its backward; the values are
    the same, but on XLA a re-gathered parameter enters the step's graph as a slice of a gather buffer instead of as
    the buffer ZeRO keeps it in, so that step runs another graph, which XLA fuses, and rounds, differently (#63: a
    resumed ZeRO-3 job's first step was not the uninterrupted job's step; all-persistent models then resume bit for
    bit). Leaf modules with ``fast_sharding_for_leaf_module`` take upstream's path (it empties the released
    parameters' data itself)."""

    @functools.wraps(original)
    def release_sub_module(self, submodule, forward=False):
        from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params, z3_leaf_module
        leaf = z3_leaf_module(submodule)
        if self.is_complete_trace() or (leaf and self.fast_sharding_for_leaf_module):
            return original(self, submodule, forward)
        kept = [param for param in iter_params(submodule, recurse=leaf) if param.ds_persist]
        for param in kept:
            param.ds_active_sub_modules.add(_PERSISTENT_HOLD)
        try:
            return original(self, submodule, forward)
        finally:
            for param in kept:
                param.ds_active_sub_modules.discard(_PERSISTENT_HOLD)

    return release_sub_module
