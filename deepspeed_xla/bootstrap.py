"""Startup hook: make ``DS_ACCELERATOR=xla`` work in every Python process.

``deepspeed_xla.pth`` (installed into site-packages) runs ``install()`` at interpreter start, in the
``deepspeed`` runner, ``deepspeed.launcher.launch``, every worker, pdsh/mpirun children and pytest.

DeepSpeed has no plugin mechanism and captures its accelerator while ``import deepspeed`` is still
running, so the only reliable moment to register is right after ``real_accelerator``'s module body
ran. A ``sys.meta_path`` finder wraps that module, the few that ``patches/`` touches, and torch_xla, after whose
import a launched worker sets up its device (``_AFTER_IMPORT``) and before whose import its model-export module is
deferred (``_BEFORE_IMPORT``).
The same finder imports the big frameworks with the cyclic garbage collector paused (``_FROZEN_IMPORTS``).
Nothing here imports torch or deepspeed:
this file costs every Python process a few stat calls and must stay that cheap (only gc/os/sys).
"""
import gc
import os
import sys

ACCELERATOR_NAME = "xla"
#: The startup file in site-packages that calls ``install()`` (setup.py puts it there).
PTH_FILE = "deepspeed_xla.pth"
#: Set to 1 to keep the hook out of an interpreter.
DISABLE_VARIABLE = "DS_XLA_DISABLE_HOOK"
#: The job's secret for the rendezvous store (``comm/authentication.py``), and the file through which a pdsh host's
#: launcher gets it (``patches/launcher.py``): a command line is logged and every user of the host can read it.
JOB_SECRET = "DS_XLA_JOB_SECRET"
JOB_SECRET_FILE = "DS_XLA_JOB_SECRET_FILE"
#: What a process wrote into its environment for itself alone (``process_env.py``), for the processes it starts to undo:
#: JSON ``{"pid": <the writer>, "vars": {name: [value before, value written]}}`` (null: unset).
PROCESS_ENV = "DS_XLA_PROCESS_ENV"

_PATCHES_HOOK = ("deepspeed_xla.patches", "on_module_loaded")
# module -> (our module, function) run right after that module's body executed. The patched modules
# must match deepspeed_xla.patches.PATCHED_MODULES (a test checks it; this file cannot import it).
_AFTER_IMPORT = {
    "deepspeed.accelerator.real_accelerator": ("deepspeed_xla.registration", "on_real_accelerator_loaded"),
    "torch_xla": ("deepspeed_xla.process_setup", "on_torch_xla_loaded"),
    "deepspeed.runtime.config": _PATCHES_HOOK,
    "deepspeed.runtime.compiler": _PATCHES_HOOK,
    "deepspeed.runtime.engine": _PATCHES_HOOK,
    "deepspeed.runtime.utils": _PATCHES_HOOK,
    "deepspeed.runtime.bf16_optimizer": _PATCHES_HOOK,
    "deepspeed.runtime.comm.coalesced_collectives": _PATCHES_HOOK,
    "deepspeed.runtime.zero.stage_1_and_2": _PATCHES_HOOK,
    "deepspeed.runtime.zero.stage3": _PATCHES_HOOK,
    "deepspeed.runtime.zero.linear": _PATCHES_HOOK,
    "deepspeed.runtime.zero.partition_parameters": _PATCHES_HOOK,
    "deepspeed.runtime.zero.parameter_offload": _PATCHES_HOOK,
    "deepspeed.runtime.zero.partitioned_param_coordinator": _PATCHES_HOOK,
    "deepspeed.runtime.fp16.loss_scaler": _PATCHES_HOOK,
    "deepspeed.runtime.fp16.fused_optimizer": _PATCHES_HOOK,
    "deepspeed.runtime.fp16.unfused_optimizer": _PATCHES_HOOK,
    "deepspeed.launcher.runner": _PATCHES_HOOK,
    "deepspeed.launcher.multinode_runner": _PATCHES_HOOK,
    "deepspeed.comm.comm": _PATCHES_HOOK,
    "deepspeed.comm.torch": _PATCHES_HOOK,
    "deepspeed.module_inject.layers": _PATCHES_HOOK,
    "deepspeed.utils.nvtx": _PATCHES_HOOK,
    "deepspeed.profiling.flops_profiler.profiler": _PATCHES_HOOK,
    "accelerate.state": _PATCHES_HOOK,
    "accelerate.utils.deepspeed": _PATCHES_HOOK,
    "transformers.trainer": _PATCHES_HOOK,
    "transformers.training_args": _PATCHES_HOOK,
    "transformers.integrations.hub_kernels": _PATCHES_HOOK,
}
# module -> (our module, function) run with the module object just before its body executes.
_BEFORE_IMPORT = {"torch_xla": ("deepspeed_xla.patches.stablehlo", "defer")}
#: Top-level packages whose import runs with the cyclic GC paused, then frozen (why: ``_exec_frozen``).
_FROZEN_IMPORTS = ("torch", "torch_xla", "deepspeed")


class _DeepSpeedFinder:
    """Meta-path finder that wraps the loaders of the few DeepSpeed modules we hook, and of the frameworks."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _AFTER_IMPORT and fullname not in _FROZEN_IMPORTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _WrappingLoader(spec.loader, _BEFORE_IMPORT.get(fullname), _AFTER_IMPORT.get(fullname),
                                              fullname in _FROZEN_IMPORTS)
                return spec
        return None


def _exec_frozen(loader, module) -> None:
    """Run a framework's import with the cyclic GC paused, then freeze the objects it made.

    torch, torch_xla (with the dynamo and inductor modules it pulls in) and DeepSpeed build about a
    million objects that live until exit. Collections during the import, and the one at exit, walk them
    again and again: seconds of CPU in every rank (docs/performance.md). Frozen objects are skipped by
    every later collection. (Nested framework imports freeze with the outermost one.)
    """
    outermost = gc.isenabled()
    gc.disable()
    try:
        loader.exec_module(module)
    finally:
        if outermost:
            gc.freeze()
            gc.enable()


def _run_hook(hook, module) -> None:
    if hook:
        import importlib
        module_name, function = hook
        getattr(importlib.import_module(module_name), function)(module)


class _WrappingLoader:

    def __init__(self, loader, before, after, frozen: bool):
        self._loader = loader
        self._before = before
        self._after = after
        self._frozen = frozen

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        _run_hook(self._before, module)
        if self._frozen:
            _exec_frozen(self._loader, module)
        else:
            self._loader.exec_module(module)
        _run_hook(self._after, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def is_active() -> bool:
    """Whether the finder is installed in this interpreter (``ds_xla_report`` asks)."""
    return any(isinstance(f, _DeepSpeedFinder) for f in sys.meta_path)


def _secret_from_file() -> None:
    """Move the job's secret from the file pdsh's command names into this process's environment, which the ranks
    it starts inherit, and remove the file: read once, by the host's first Python process."""
    path = os.environ.pop(JOB_SECRET_FILE, "")
    if not path:
        return
    path = os.path.expanduser(path)
    try:
        with open(path, encoding="utf-8") as file:
            os.environ[JOB_SECRET] = file.read().strip()
        os.unlink(path)
    except OSError as error:  # the ranks then stop at their first process group, naming the secret's difference
        sys.stderr.write(f"[deepspeed_xla] cannot read this job's {JOB_SECRET} from {path}: {error}\n")


def restore_inherited_env() -> None:
    """Put back what the process that started this one wrote into its environment for itself alone (its device
    topology, its rank of a one-process world): a child of a prepared process counts the host's devices and sets up
    its own. Runs at interpreter start and in a fork child (``process_env``); the writer itself keeps its values."""
    record = os.environ.get(PROCESS_ENV)
    if record is None:
        return
    import json
    try:
        record = json.loads(record)
        if record["pid"] == os.getpid():
            return
        changes = [(name, (before, written)) for name, (before, written) in record["vars"].items()]
    except (ValueError, KeyError, TypeError, AttributeError):  # not ours to read: drop it, start as given
        changes = []
    del os.environ[PROCESS_ENV]
    undo_changes(os.environ, changes)


def undo_changes(env: "MutableMapping[str, str]", changes: "Iterable[Tuple[str, Tuple[Optional[str], Optional[str]]]]"
                 ) -> None:
    """Each ``(name, (value before, value written))`` back to its value before, unless the variable holds another
    value than the one written: that one was set since, for the children."""
    for name, (before, written) in changes:
        if env.get(name) != written:
            continue
        if before is None:
            env.pop(name, None)
        else:
            env[name] = before


def install() -> None:
    """Install the finder once per interpreter (``DS_XLA_DISABLE_HOOK=1`` turns it off); undo a parent's own
    environment in any case."""
    restore_inherited_env()
    if os.environ.get(DISABLE_VARIABLE) == "1":
        return
    _secret_from_file()
    if is_active():
        return
    sys.meta_path.insert(0, _DeepSpeedFinder())
