"""torch.distributed backends for XLA tensors.

- ``host_staged`` (``xla_host``): PJRT CPU, where XLA has no cross-process collectives.
- ``xla_collectives`` (``xla_ds``): TPU, torch_xla's ``xla`` backend with DeepSpeed's gaps filled
  (real barriers, CPU tensors for object collectives, coalesced all-reduce, uneven all-to-all,
  replica groups that tile the world) and send/recv through host memory (``docs/pipeline.md``).

The device type (``deepspeed_xla.devices``) names which one a process uses.
"""


def completed_work(result=None):
    """A finished ``dist.Work``: our process groups complete collectives before returning."""
    import torch
    future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)
