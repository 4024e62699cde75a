"""DeepSpeed's NVTX ranges, which the XLA accelerator does not record.

DeepSpeed wraps its busiest methods in ``instrument_w_nvtx``: ZeRO-3's fetch and release of every module's
parameters, its gradient hooks, the engine's forward, backward and step. Each call of the wrapper asks whether torch
is compiling and looks up the accelerator, twice, to push and pop a range that ``XLA_Accelerator.range_push``
ignores: ~4,000 calls a step for ZeRO-3 at 16 layers, host time the device waits for (docs/performance.md, 'ZeRO-3's
hooks in the profiler'). DeepSpeed's own switch turns the wrapper into one global lookup.
"""


def ranges_off(original: bool) -> bool:
    """``deepspeed.utils.nvtx.enable_nvtx``, which every wrapper reads when it is called."""
    return False
