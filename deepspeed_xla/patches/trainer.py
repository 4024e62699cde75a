"""Patches of transformers' Trainer (``transformers.trainer``, ``.training_args``): a DeepSpeed run on XLA is a
torch.distributed job, not torch_xla's own multi-process training.

The Trainer takes its torch_xla branch, where there is one, before its DeepSpeed or torch.distributed one. Those
branches are written for ``xmp.spawn`` training: ``xm.save`` of the optimizer's state dict and of a model state
dict that ZeRO-3 holds partitioned (skipping the engine's ``save_checkpoint``, which ``resume_from_checkpoint``
loads), ``xm.mesh_reduce`` of the logged loss and ``xm.rendezvous`` barriers, which on PJRT CPU see one process.
Under DeepSpeed the Trainer takes the branches it takes on a GPU; the device itself stays XLA (its ``mark_step``
calls and XLA RNG state are kept).
"""
import contextlib
import functools


@contextlib.contextmanager
def _torch_xla_hidden(module_name: str):
    """``module_name`` reads ``is_torch_xla_available()`` at each branch; it answers False meanwhile."""
    import importlib
    module = importlib.import_module(module_name)
    shown = module.is_torch_xla_available
    module.is_torch_xla_available = lambda *args, **kwargs: False
    try:
        yield
    finally:
        module.is_torch_xla_available = shown


def saves_through_deepspeed(original):
    """A Trainer save method that, with a DeepSpeed engine, saves the way the Trainer does on a GPU."""

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if not self.is_deepspeed_enabled:
            return original(self, *args, **kwargs)
        with _torch_xla_hidden("transformers.trainer"):
            return original(self, *args, **kwargs)

    return method


def grad_norm_read_when_logged(original):
    """``Trainer._get_grad_norm`` leaves DeepSpeed's gradient norm on the device: the Trainer reads it when it logs
    it (``.item()``), instead of after every optimizer step, where the read waits for the step's graph to run."""

    @functools.wraps(original)
    def _get_grad_norm(self, model, grad_norm=None):
        import torch
        if self.is_deepspeed_enabled and grad_norm is None:  # no clipping: the engine's norm, as upstream asks
            grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
        if self.is_deepspeed_enabled and torch.is_tensor(grad_norm):
            return grad_norm.detach()
        return original(self, model, grad_norm=grad_norm)

    return _get_grad_norm


def _is_deepspeed_run(args) -> bool:
    from accelerate.utils import DistributedType
    state = args.__dict__.get("distributed_state")
    return state is not None and state.distributed_type == DistributedType.DEEPSPEED


def distributed_under_deepspeed(original: property) -> property:
    """``TrainingArguments.parallel_mode``: ``DISTRIBUTED`` for a DeepSpeed run (``TPU`` means torch_xla's own
    replication), so that the Trainer sums FLOPs and gathers what it logs over torch.distributed."""

    @functools.wraps(original.fget)
    def parallel_mode(self):
        from transformers.training_args import ParallelMode
        return ParallelMode.DISTRIBUTED if _is_deepspeed_run(self) else original.fget(self)

    return property(parallel_mode, doc=original.__doc__)


def gathers_by_parallel_mode(original):
    """The Trainer's ``nested_gather`` (what it logs as the loss: the mean over ranks) over torch.distributed when
    ``parallel_mode`` says so, as it does under DeepSpeed, instead of ``xm.mesh_reduce``."""

    @functools.wraps(original)
    def nested_gather(tensors, parallel_mode, name=None):
        from transformers.trainer_pt_utils import distributed_concat
        from transformers.training_args import ParallelMode
        if tensors is not None and parallel_mode == ParallelMode.DISTRIBUTED:
            return distributed_concat(tensors)
        return original(tensors, parallel_mode, name)

    return nested_gather


def barrier_by_parallel_mode(original):
    """``TrainingArguments.main_process_first`` waits on torch.distributed barriers in a DeepSpeed run
    (``xm.rendezvous`` sees one process per PJRT CPU rank: the others would not wait)."""

    @functools.wraps(original)
    @contextlib.contextmanager
    def main_process_first(self, *args, **kwargs):
        deepspeed_run = _is_deepspeed_run(self)
        with _torch_xla_hidden("transformers.training_args") if deepspeed_run else contextlib.nullcontext():
            with original(self, *args, **kwargs):
                yield

    return main_process_first
