"""What a patch is, and how one is checked against upstream and applied.

A ``Patch`` names one attribute of DeepSpeed (or of accelerate or transformers, which DeepSpeed runs under), the
wrapper that replaces it and the digest of the upstream source the wrapper was written against. This module
imports nothing from deepspeed_xla (only the standard library; the patched modules are imported by name when a
patch is checked or applied), so the subsystem modules and ``__init__``'s table can all build on it.
"""
import functools
import hashlib
import importlib
import inspect
import warnings
from typing import Callable, Dict, List, NamedTuple, Tuple

WRITTEN_FOR = "0.19.8"
#: The release of each patched distribution the wrappers were written for.
VERSIONS = {"deepspeed": WRITTEN_FOR, "accelerate": "1.15.0", "transformers": "5.23.0", "torch_xla": "2.9.0"}
#: sha256 prefix of each upstream file (by module) that defines code a patch reads, at ``VERSIONS``. A patch whose
#: files all match has the source its digest was taken from, so every process start skips reading that source
#: (``inspect.getsource`` tokenizes each function and parses the whole file of a class).
UPSTREAM_FILES = {
    "accelerate.state": "8af1fe9a518f46bc",
    "accelerate.utils.deepspeed": "82dfa3c0ea4eb51b",
    "deepspeed.comm.torch": "e1ed1e77862a4048",
    "deepspeed.launcher.multinode_runner": "888fe4888604b4cd",
    "deepspeed.launcher.runner": "956d554ea5c9b142",
    "deepspeed.module_inject.layers": "759279bfa77043a6",
    "deepspeed.runtime.bf16_optimizer": "12b5e15e30a6e4b4",
    "deepspeed.runtime.checkpoint_engine.utils": "dcf4c8dcbebc12d4",
    "deepspeed.runtime.compiler": "519b1947e9fa6c43",
    "deepspeed.runtime.config": "4e45da379fdeb14c",
    "deepspeed.runtime.engine": "e35eaa313874d2b3",
    "deepspeed.runtime.fp16.fused_optimizer": "e15157a8bcdea84c",
    "deepspeed.runtime.fp16.unfused_optimizer": "6081dd055585c178",
    "deepspeed.runtime.utils": "f50261801c3407d3",
    "deepspeed.runtime.zero.linear": "268ef26f394f2b3e",
    "deepspeed.runtime.zero.parameter_offload": "7fec7e04a5d00a56",
    "deepspeed.runtime.zero.partition_parameters": "c7866c302ef1a975",
    "deepspeed.runtime.zero.stage3": "4ff3fdb4cbabaddf",
    "deepspeed.runtime.zero.stage_1_and_2": "752235af95d0de6f",
    "deepspeed.utils.config": "3b897ee836bff115",
    "deepspeed.utils.nvtx": "1ca82972b9f95b35",
    "transformers.trainer": "da5a792ffed97570",
    "transformers.trainer_pt_utils": "464c0711a0fd4260",
    "transformers.training_args": "fbdd5980f654c8c5",
}


class Patch(NamedTuple):
    module: str
    #: Class holding ``attr``, or "" for a module-level name.
    owner: str
    attr: str
    #: Called with the upstream value; returns the replacement.
    wrapper: Callable
    #: sha256 prefix of the upstream source the wrapper was written against.
    digest: str
    #: The functions of ``owner`` the patch relies on, when not (only) ``attr``: for a data attribute, the
    #: function using it; for a wrapper that re-implements a callee, both. The digest is of their sources.
    reads: Tuple[str, ...] = ()

    @property
    def distribution(self) -> str:
        """The installed distribution that holds ``module`` (``VERSIONS``' key)."""
        return self.module.split(".")[0]


def source_digest(*funcs) -> str:
    return hashlib.sha256("".join(inspect.getsource(func) for func in funcs).encode()).hexdigest()[:16]


_applied = set()


def _owner(patch: Patch):
    module = importlib.import_module(patch.module)
    return getattr(module, patch.owner) if patch.owner else module


def _function(owner, name: str):
    """The upstream function behind ``owner.name``, unwrapped; a property's getter."""
    declared = inspect.getattr_static(owner, name) if isinstance(owner, type) else None
    return inspect.unwrap(declared.fget if isinstance(declared, property) else getattr(owner, name))


def upstream_code(patch: Patch) -> List:
    """The upstream functions (or classes) the patch depends on, unwrapped."""
    owner = _owner(patch)
    return [_function(owner, name) for name in patch.reads or (patch.attr, )]


def upstream_digest(patch: Patch) -> str:
    """Digest of the upstream code the patch depends on, whether or not the patch is applied."""
    return source_digest(*upstream_code(patch))


@functools.lru_cache(maxsize=None)
def file_digest(path: str) -> str:
    with open(path, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()[:16]


def upstream_files(patch: Patch) -> Dict[str, str]:
    """The installed digest of each file holding the patch's upstream code, by module (as ``UPSTREAM_FILES``)."""
    return {code.__module__: file_digest(inspect.getsourcefile(code)) for code in upstream_code(patch)}


def _files_unchanged(patch: Patch) -> bool:
    """Whether every file holding the patch's upstream code is the one ``UPSTREAM_FILES`` recorded."""
    return all(UPSTREAM_FILES.get(module) == digest for module, digest in upstream_files(patch).items())


def is_applied(patch: Patch) -> bool:
    return patch in _applied


def _apply(module, patch: Patch) -> None:
    if patch in _applied:
        return
    if not _files_unchanged(patch) and upstream_digest(patch) != patch.digest:
        warnings.warn(f"deepspeed_xla: {patch.module}.{patch.owner}.{patch.attr} differs from {patch.distribution} "
                      f"{VERSIONS[patch.distribution]}; patched anyway, re-check deepspeed_xla/patches/ against this "
                      f"{patch.distribution}.")
    owner = _owner(patch)
    setattr(owner, patch.attr, patch.wrapper(getattr(owner, patch.attr, None)))
    _applied.add(patch)
