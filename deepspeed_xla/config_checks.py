"""DeepSpeed config settings that cannot run on this XLA device, refused with one error that names the fix.

``patches/config.py`` calls ``check_config`` while DeepSpeed parses the config (``DeepSpeedConfig``, inside
``deepspeed.initialize``), before the engine builds anything or touches the device, so a bad setting
costs the user no compilation. Settings that work are left alone: offloading to ``cpu`` (DeepSpeed's host
optimizers update host copies of the XLA parameters), and ``nvme`` under ZeRO-1/2, which DeepSpeed
treats as ``cpu``. See docs/bad_input.md.
"""
from typing import List, Optional, Tuple

import torch

from deepspeed_xla.devices import current_device_type
from deepspeed_xla.op_builder import create_op_builder
from deepspeed_xla.launch_env import launched

# The DeepSpeed op each optimizer type runs on the device (without offload; torch.optim types need none).
_DEVICE_OPTIMIZER_OPS = {"adam": "FusedAdamBuilder", "adamw": "FusedAdamBuilder", "lamb": "FusedLambBuilder",
                         "lion": "FusedLionBuilder"}
# ZeRO-3's NVMe swapper reads and writes through this op.
_NVME_OP = "AsyncIOBuilder"
# ZeRO++'s quantized weights and gradients are (de)quantized by this op's kernels.
_QUANTIZER_OP = "QuantizerBuilder"
_ZEROPP_QUANTIZATION = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
# 1-bit optimizers DeepSpeed 0.19.8 no longer has (its engine rejects them on every accelerator), and their
# uncompressed counterparts.
_ONEBIT_OPTIMIZERS = {"onebitadam": '"Adam" or "AdamW"', "zerooneadam": '"Adam" or "AdamW"', "onebitlamb": '"Lamb"'}


def refused_settings() -> List[Tuple[str, str]]:
    """What ``check_config`` refuses, as ``(setting, what to use instead)``: ``ds_xla_report`` lists them."""
    return list(_CHECKS.values())


def check_config(config) -> None:
    """Raise ValueError for the first setting of ``config`` (a ``DeepSpeedConfig``) this device cannot run."""
    for check in _CHECKS:
        problem = check(config)
        if problem:
            raise ValueError(problem)


def check_batch_size(config) -> None:
    """Explain DeepSpeed's failed batch-size assertion: which product is off and what to set (no-op if it holds)."""
    train, micro = config.train_batch_size, config.train_micro_batch_size_per_gpu
    steps, world = config.gradient_accumulation_steps, int(config.world_size)
    if not (train and micro and steps) or train == micro * steps * world:
        return
    fixes = [f"set train_batch_size to {micro * steps * world} (or leave it out and DeepSpeed derives it)"]
    processes, remainder = divmod(train, micro * steps)
    if remainder == 0 and processes != world:
        fixes.append(f"run {processes} data-parallel processes (e.g. deepspeed --num_gpus {processes})")
    note = ""
    if world == 1 and not launched():
        note = (" This process was started with plain python, so it trains alone; start it with the deepspeed "
                "launcher to train on several devices.")
    raise ValueError(f"train_batch_size {train} is not train_micro_batch_size_per_gpu {micro} x "
                     f"gradient_accumulation_steps {steps} x {world} data-parallel process(es): "
                     f"{', or '.join(fixes)}.{note}") from None


def _has_xla_op(builder_name: str) -> bool:
    return create_op_builder(builder_name).is_compatible()


def _fp16_problem(config) -> Optional[str]:
    device = current_device_type()
    if device.is_fp16_supported():
        return None
    if config.float16_config.enabled:
        setting, fix = '"fp16": {"enabled": true}', 'replace it with "bf16": {"enabled": true}'
    elif config.torch_autocast_enabled and config.torch_autocast_dtype == torch.float16:
        setting, fix = '"torch_autocast" with float16', 'set its "dtype" to "torch.bfloat16"'
    else:
        return None
    return (f"{setting} is set, but deepspeed_xla does not support float16 training on PJRT {device.pjrt_name}: "
            f"{fix} in the DeepSpeed config (bfloat16 needs no loss scaling).")


def _optimizer_problem(config) -> Optional[str]:
    name = config.optimizer_name
    op = _DEVICE_OPTIMIZER_OPS.get(name)
    offload = config.zero_config.offload_optimizer
    if op is None or (offload is not None and offload.device != "none") or _has_xla_op(op):
        return None
    return (f'optimizer "type": "{name}" runs DeepSpeed\'s {op} op on the device, and that op has no XLA '
            'implementation: use "AdamW", "Adam" or "Lamb", a torch.optim name such as "SGD", or keep the optimizer '
            'on the host with "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}.')


def _nvme_problem(config) -> Optional[str]:
    zero = config.zero_config
    on_nvme: List[str] = [name for name, offload in (("offload_param", zero.offload_param),
                                                      ("offload_optimizer", zero.offload_optimizer))
                          if offload is not None and offload.device == "nvme"]
    if config.zero_optimization_stage != 3 or not on_nvme or _has_xla_op(_NVME_OP):
        return None
    return (f'ZeRO-3 {" and ".join(on_nvme)} to "nvme" needs DeepSpeed\'s async_io op, which deepspeed_xla does not '
            f'provide: set "device": "cpu" in {" and ".join(on_nvme)} to offload to host memory instead.')


def _zeropp_quantization_problem(config) -> Optional[str]:
    quantized = [name for name in _ZEROPP_QUANTIZATION if getattr(config.zero_config, name)]
    if not quantized or _has_xla_op(_QUANTIZER_OP):
        return None
    return (f'ZeRO++ quantization ({", ".join(quantized)}) needs DeepSpeed\'s {_QUANTIZER_OP} op (CUDA kernels '
            'that quantize weights or gradients around each collective), which has no XLA implementation: set '
            f'{", ".join(quantized)} to false in "zero_optimization". ZeRO++\'s hierarchical partitioning '
            '("zero_hpz_partition_size") runs without it.')


def _onebit_problem(config) -> Optional[str]:
    name = (config.optimizer_name or "").lower()
    if name not in _ONEBIT_OPTIMIZERS:
        return None
    return (f'optimizer "type": "{config.optimizer_name}" is a 1-bit optimizer, which DeepSpeed 0.19.8 no longer has '
            f'(its engine refuses it on every accelerator): use {_ONEBIT_OPTIMIZERS[name]}, which trains with '
            'uncompressed gradients.')


def _deepcompile_problem(config) -> Optional[str]:
    if not config.compile_config.deepcompile:
        return None
    return ('"compile": {"deepcompile": true} is set, but DeepCompile builds its graphs with the inductor or eager '
            'torch.compile backends and CUDA/CPU collectives, not with XLA: remove "deepcompile" (XLA already compiles '
            'each step into one graph), or call engine.compile() for torch.compile with the openxla backend.')


def _autotuning_problem(config) -> Optional[str]:
    if not config.autotuning_config.enabled:
        return None
    return ('"autotuning": {"enabled": true} is set, but DeepSpeed\'s autotuner times a few steps of each experiment '
            'with the device synchronized around every module, which on XLA compiles new graphs in the very steps it '
            'times: remove "autotuning" and choose train_micro_batch_size_per_gpu and the ZeRO stage by timing '
            'steps after the first few, which compile (docs/performance.md).')


# Each check, with the setting it refuses and the way out (the short form of its error, for ds_xla_report).
_CHECKS = {
    _fp16_problem: ('"fp16", or "torch_autocast" in float16 (TPU, PJRT CPU)', '"bf16"'),
    _optimizer_problem: ('an optimizer "type" whose op has no XLA implementation (e.g. "Lion")',
                         '"AdamW", "Adam", "Lamb", a torch.optim name, or "offload_optimizer" to "cpu"'),
    _nvme_problem: ('ZeRO-3 "offload_param"/"offload_optimizer" to "nvme"', '"device": "cpu"'),
    _zeropp_quantization_problem: ('ZeRO++ quantization ("zero_quantized_weights", '
                                   '"zero_quantized_nontrainable_weights", "zero_quantized_gradients")',
                                   'false; "zero_hpz_partition_size" runs'),
    _onebit_problem: ('1-bit optimizers ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")', '"Adam"/"AdamW", "Lamb"'),
    _deepcompile_problem: ('"compile": {"deepcompile": true}', 'engine.compile() (torch.compile, openxla backend)'),
    _autotuning_problem: ('"autotuning": {"enabled": true}',
                          'your own micro batch and ZeRO stage, timed after the first steps'),
}
