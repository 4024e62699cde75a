"""torch.distributed backends for XLA tensors.

- ``host_staged`` (``xla_host``): PJRT CPU, where XLA has no cross-process collectives.
- TPU uses torch_xla's own ``xla`` backend (``torch_xla.distributed.xla_backend``).

The device type (``deepspeed_xla.devices``) names which one a process uses.
"""
