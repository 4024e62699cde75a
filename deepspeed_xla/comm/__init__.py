"""torch.distributed backends for XLA tensors.

- ``host_staged`` (``xla_host``): PJRT CPU, where XLA has no cross-process collectives.
- ``xla_collectives`` (``xla_ds``): TPU, torch_xla's ``xla`` backend with DeepSpeed's gaps filled
  (real barriers, CPU tensors for object collectives, coalesced all-reduce, uneven all-to-all,
  replica groups that tile the world) and send/recv through host memory (``docs/pipeline.md``).

``backends`` registers them. This file imports none of the package's modules, each of which Python imports it
before: the package's imports run one way, from ``backends`` down to ``staging`` and ``work``.
"""
