"""Every run-time change to DeepSpeed internals, in one place, each guarded by the version it was written for.

The startup hook calls ``on_module_loaded`` as each target module finishes importing, and only when
the XLA accelerator is active. ``tests/test_patches.py`` fails when an upstream target changes.
"""
import contextlib
import functools
import hashlib
import inspect
import warnings
from importlib import metadata
from typing import Callable, NamedTuple

WRITTEN_FOR = "0.19.8"


@contextlib.contextmanager
def keep_parameter_objects():
    """Make ``module.to(xla)`` swap tensor contents into the existing Parameter objects.

    A CPU Parameter cannot take an XLA tensor as ``.data``, so torch replaces the Parameter, and the
    optimizer (built from the user's ``model.parameters()``) keeps training the stale CPU tensors.
    """
    import torch
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _engine_configure_distributed_model(original):

    @functools.wraps(original)
    def configure(self, model):
        from deepspeed.utils import debug
        # DeepSpeed's debug name maps hold weakrefs to every parameter, and swapping refuses weakref'd
        # tensors: drop the maps for the move and rebuild them (ids do not change) afterwards.
        debug.debug_clear_module_and_param_names()
        try:
            with keep_parameter_objects():
                return original(self, model)
        finally:
            debug.debug_extract_module_and_param_names(model)

    return configure


def _engine_take_model_step(original):
    """End the lazy graph at the optimizer step: one XLA execution per step, bounded graph size.

    DeepSpeed never marks steps (eager devices need no marker); without one the traced graph
    grows across steps until the compiler runs out of memory. The pipeline engine steps here too.
    """

    @functools.wraps(original)
    def take_model_step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        from deepspeed_xla import xla_runtime
        xla_runtime.sync(wait=False)
        return result

    return take_model_step


def _engine_configure_zero_optimizer(original):
    """Size ZeRO's communication buckets to the model before ZeRO allocates them.

    ZeRO allocates its gradient buckets with ``torch.empty(reduce_bucket_size)`` (default 5e8
    elements) every step. CUDA leaves untouched memory unbacked; XLA materializes the whole buffer,
    which on a small model is gigabytes of zeros per step. A bucket never holds more than every
    parameter, so capping the sizes at the parameter count changes no result.
    """

    @functools.wraps(original)
    def configure(self, optimizer):
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters())
        zero = self._config.zero_config
        for field in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            if getattr(zero, field, 0) > numel:
                setattr(zero, field, numel)
        return original(self, optimizer)

    return configure


def _has_inf_or_nan(original):
    """Test every element: DeepSpeed's ``isfinite(x.amax())`` trick is wrong on XLA twice over.

    torch_xla 2.9's ``amax()``/``amin()`` without ``dim`` do not reduce (the in-place accumulation into
    a 1-element counter then fails: bf16 ZeRO-1/2, fp16 loss scaling), and XLA's max reduction drops
    NaN instead of propagating it. XLA fuses the elementwise test into the reduction, so no mask is
    materialized (the cost the upstream trick avoids on eager devices).
    """

    @functools.wraps(original)
    def has_inf_or_nan(x):
        if x.device.type != "xla" or x.is_sparse or x.numel() == 0:
            return original(x)
        import torch
        return torch.isfinite(x).all().logical_not()

    return has_inf_or_nan


_ENV_FILE_NAME = ".deepspeed_env"


@functools.lru_cache(maxsize=None)
def _normalized_env_dir() -> str:
    """One clean ``.deepspeed_env`` holding what our parser read from the user's files, or "" if none."""
    import os
    import tempfile
    from deepspeed_xla.env_file import merged_env_values
    merged = merged_env_values()
    if not merged:
        return ""
    folder = tempfile.mkdtemp(prefix="deepspeed_xla_env_")
    with open(os.path.join(folder, _ENV_FILE_NAME), "w") as handle:
        handle.writelines(f"{key}={value}\n" for key, value in merged.items())
    return folder


def _runner_env_paths(original):
    """Multi-node runs: DeepSpeed's runner re-reads ``.deepspeed_env`` with a parser that fails on blank
    lines and comments; point it at a normalized copy of what deepspeed_xla already parsed."""
    folder = _normalized_env_dir()
    return [folder] if folder else original


def _runner_env_name(original):
    return _ENV_FILE_NAME if _normalized_env_dir() else original


class Patch(NamedTuple):
    module: str
    #: Class holding ``attr``, or "" for a module-level name.
    owner: str
    attr: str
    #: Called with the upstream value; returns the replacement.
    wrapper: Callable
    #: sha256 prefix of the upstream source the wrapper was written against.
    digest: str
    #: For a data attribute: the function whose use of it the patch relies on (digest is of its source).
    reads: str = ""


# DeepSpeed imports has_inf_or_nan by name, so every importing module's binding is patched.
_HAS_INF_OR_NAN_DIGEST = "f2891c8e640be50c"

PATCHES = [
    *(Patch(module, "", "has_inf_or_nan", _has_inf_or_nan, _HAS_INF_OR_NAN_DIGEST)
      for module in ("deepspeed.runtime.utils", "deepspeed.runtime.zero.stage_1_and_2",
                     "deepspeed.runtime.zero.stage3", "deepspeed.runtime.fp16.loss_scaler")),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_distributed_model",
          _engine_configure_distributed_model, "a9a57b807f5eed72"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_zero_optimizer",
          _engine_configure_zero_optimizer, "f31cf07a5d4f4170"),
    Patch("deepspeed.runtime.engine", "DeepSpeedEngine", "_take_model_step", _engine_take_model_step,
          "c4c6e01aa1fc4e7d"),
    Patch("deepspeed.launcher.runner", "", "DEEPSPEED_ENVIRONMENT_PATHS", _runner_env_paths, "d40ac82930b5b28f",
          reads="main"),
    Patch("deepspeed.launcher.runner", "", "DEEPSPEED_ENVIRONMENT_NAME", _runner_env_name, "d40ac82930b5b28f",
          reads="main"),
]

PATCHED_MODULES = sorted({p.module for p in PATCHES})


def source_digest(func) -> str:
    return hashlib.sha256(inspect.getsource(func).encode()).hexdigest()[:16]


def _xla_is_active() -> bool:
    from deepspeed.accelerator import real_accelerator
    return getattr(real_accelerator.ds_accelerator, "_name", None) == "xla"


def on_module_loaded(module) -> None:
    """Startup-hook entry: patch ``module`` if the XLA accelerator is DeepSpeed's accelerator."""
    if not _xla_is_active():
        return
    installed = metadata.version("deepspeed")
    if installed != WRITTEN_FOR:
        warnings.warn(f"deepspeed_xla's patches were written for DeepSpeed {WRITTEN_FOR}, found {installed}: "
                      f"install deepspeed=={WRITTEN_FOR}.")
    for patch in PATCHES:
        if patch.module == module.__name__:
            _apply(module, patch)


_applied = set()


def _owner(patch: Patch):
    import importlib
    module = importlib.import_module(patch.module)
    return getattr(module, patch.owner) if patch.owner else module


def upstream_digest(patch: Patch) -> str:
    """Digest of the upstream code the patch depends on, whether or not the patch is applied."""
    return source_digest(inspect.unwrap(getattr(_owner(patch), patch.reads or patch.attr)))


def is_applied(patch: Patch) -> bool:
    return patch in _applied


def _apply(module, patch: Patch) -> None:
    if patch in _applied:
        return
    if upstream_digest(patch) != patch.digest:
        warnings.warn(f"deepspeed_xla: {patch.module}.{patch.owner}.{patch.attr} differs from DeepSpeed "
                      f"{WRITTEN_FOR}; patched anyway, re-check deepspeed_xla/patches.py against this DeepSpeed.")
    owner = _owner(patch)
    setattr(owner, patch.attr, patch.wrapper(getattr(owner, patch.attr)))
    _applied.add(patch)


def apply_all() -> None:
    """Patch every target module that is already imported (the explicit ``register()`` route)."""
    import sys
    for name in PATCHED_MODULES:
        if name in sys.modules:
            on_module_loaded(sys.modules[name])
