"""Install ``XLA_Accelerator`` as DeepSpeed's accelerator.

Called by the startup hook right after ``deepspeed.accelerator.real_accelerator`` ran its module
body, which is before ``import deepspeed`` first calls ``get_accelerator()`` (and before
``deepspeed.ops.op_builder`` binds builder names). ``register()`` is the explicit route.
"""
import os
import sys
import warnings

from deepspeed_xla.bootstrap import ACCELERATOR_NAME
from deepspeed_xla.devices import wants_xla
from deepspeed_xla.launch_env import fill_scheduler_env, is_deepspeed_runner, is_launcher_process


def on_real_accelerator_loaded(module) -> None:
    if is_deepspeed_runner():
        from deepspeed_xla.env_file import apply_deepspeed_env
        apply_deepspeed_env(os.environ)
    if ACCELERATOR_NAME not in module.SUPPORTED_ACCELERATOR_LIST:
        module.SUPPORTED_ACCELERATOR_LIST.append(ACCELERATOR_NAME)
    if module.ds_accelerator is None and wants_xla():
        from deepspeed_xla.accelerator import XLA_Accelerator
        module.ds_accelerator = XLA_Accelerator()
        os.environ.setdefault("DS_ACCELERATOR", ACCELERATOR_NAME)
        if not is_launcher_process():  # at start-up: scripts read LOCAL_RANK while parsing their arguments
            fill_scheduler_env(os.environ)


def register():
    """Make ``XLA_Accelerator`` DeepSpeed's accelerator from inside a running process.

    The startup hook already does this for ``DS_ACCELERATOR=xla``; after ``import deepspeed`` it is late:
    names DeepSpeed bound at import (op builders, launcher defaults) still point at the old accelerator.
    """
    from deepspeed.accelerator import real_accelerator
    from deepspeed_xla.accelerator import XLA_Accelerator
    on_real_accelerator_loaded(real_accelerator)
    if not isinstance(real_accelerator.ds_accelerator, XLA_Accelerator):
        if "deepspeed.ops.op_builder" in sys.modules:
            warnings.warn("deepspeed_xla.register() ran after `import deepspeed`: names DeepSpeed bound at import "
                          "(deepspeed.ops.op_builder.*Builder) still use the previous accelerator. Set "
                          "DS_ACCELERATOR=xla before starting Python instead.")
        real_accelerator.set_accelerator(XLA_Accelerator())
    from deepspeed_xla import patches
    patches.apply_all()
    return real_accelerator.ds_accelerator
