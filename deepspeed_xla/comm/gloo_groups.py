"""Groups asked for as gloo get the ``xla_host`` backend once a deepspeed_xla backend is registered.

torch.distributed builds a plain ``ProcessGroupGloo`` for ``new_group(backend="gloo")`` (or ``"cpu:gloo"``,
``new_subgroups(backend="gloo")``, a DeviceMesh whose dimension overrides its backend with gloo). gloo reads
only CPU tensors: handed an XLA tensor it stops (``ProcessGroupGloo::broadcast: unsupported device type
xla``) or, on other paths, reads no data. Code asks for gloo groups to move host data (objects, metrics,
checkpoint coordination) and then hands them model tensors. ``xla_host`` is gloo on host memory as well and
passes CPU tensors to gloo as they are, so giving it instead changes nothing for CPU tensors and stages XLA
ones. Every group torch creates, the default one included, is built by ``_new_process_group_helper``: that
is the one function wrapped. Such a group names its backend ``xla_host`` (``dist.get_backend``). A default
group made with gloo before the backend was registered cannot be replaced: that is an error naming the call.
"""
import functools

import torch.distributed as dist
from torch.distributed import distributed_c10d


def _names_gloo(backend) -> bool:
    """``"gloo"``, or a ``"device:backend,..."`` spec with gloo for some device."""
    return "gloo" in (pair.split(":")[-1].strip() for pair in str(backend).lower().split(","))


def install(host_backend: str) -> None:
    """From now on, groups created with gloo get ``host_backend`` (registered) instead; once per process."""
    if dist.is_initialized() and _names_gloo(dist.get_backend()):
        raise RuntimeError(
            f"torch.distributed's default group is {dist.get_backend()!r}: init_process_group() ran before "
            "deepspeed.init_distributed(), and gloo cannot read XLA tensors, which DeepSpeed would hand it. Let "
            "deepspeed.init_distributed() create the group, or pass init_process_group(backend="
            "get_accelerator().communication_backend_name()).")
    helper = distributed_c10d._new_process_group_helper
    if getattr(helper, "gloo_becomes", None) is not None:
        return

    @functools.wraps(helper)
    def new_process_group(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        backend = host_backend if _names_gloo(backend) else backend
        return helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)

    new_process_group.gloo_becomes = host_backend
    distributed_c10d._new_process_group_helper = new_process_group
