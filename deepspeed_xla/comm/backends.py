"""Registering this package's torch.distributed backends, and running what they have queued.

Nothing registers at import: the accelerator registers the backend its device type names, saying whether device
buffers are host memory. This package never asks which device it runs on. From then on, groups asked for as gloo are
``xla_host`` groups (``gloo_groups``): XLA tensors never reach plain gloo. The groups a script leaves are destroyed at
its exit, while the interpreter is whole: most scripts never call ``destroy_process_group``, and a gloo group destroyed
during the interpreter's finalization can abort the process after a finished run ("terminate called without an active
exception", pytorch/pytorch#190489).
"""
import atexit
import functools
import importlib

import torch.distributed as dist

#: Backend name -> the module whose ``register()`` adds it to torch.distributed.
BACKENDS = {"xla_host": "deepspeed_xla.comm.host_staged", "xla_ds": "deepspeed_xla.comm.xla_collectives"}


def register_backend(name: str, host_addressable: bool) -> str:
    """Register backend ``name`` with torch.distributed (once per process); returns ``name``.

    ``host_addressable``: device buffers are host memory that gloo can read and fill in place (PJRT CPU),
    so staging needs no copies.
    """
    if name not in BACKENDS:
        raise ValueError(f"{name!r} is not a deepspeed_xla backend; use one of {', '.join(BACKENDS)}.")
    from deepspeed_xla.comm import gloo_groups, host_staged, staging
    staging.configure(zero_copy=host_addressable)
    importlib.import_module(BACKENDS[name]).register()
    host_staged.register()
    gloo_groups.install(host_staged.BACKEND_NAME)
    _destroy_groups_at_exit()
    return name


@functools.lru_cache(maxsize=None)
def _destroy_groups_at_exit() -> None:
    """Registered before the world group's watchdog (``watchdog.start``), so it runs after the watchdog's exit,
    which keeps rank 0's store up for the other ranks."""
    atexit.register(destroy_groups)


def destroy_groups() -> None:
    """Every process group this process still has (its worker threads joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def run_issued() -> None:
    """Run the collectives issued and not yet waited on (the host-staged backend queues ``async_op=True`` ops until
    a wait): what ``XLA_Accelerator.synchronize`` waits for, as ``torch.cuda.synchronize`` waits for NCCL's."""
    from deepspeed_xla.comm import work
    work.ISSUED.run()
