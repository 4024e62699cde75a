"""What a patch is, and how one is checked against upstream and applied.

A ``Patch`` names one attribute of DeepSpeed (or of accelerate or transformers, which DeepSpeed runs under), the
wrapper that replaces it and the digest of the upstream source the wrapper was written against. This module
imports nothing from deepspeed_xla (only the standard library; the patched modules are imported by name when a
patch is checked or applied), so the subsystem modules and ``__init__``'s table can all build on it.
"""
import hashlib
import importlib
import inspect
import warnings
from typing import Callable, NamedTuple, Tuple

WRITTEN_FOR = "0.19.8"
#: The release of each patched distribution the wrappers were written for.
VERSIONS = {"deepspeed": WRITTEN_FOR, "accelerate": "1.15.0", "transformers": "5.23.0", "torch_xla": "2.9.0"}


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


def upstream_digest(patch: Patch) -> str:
    """Digest of the upstream code the patch depends on, whether or not the patch is applied."""
    owner = _owner(patch)
    return source_digest(*(_function(owner, name) for name in patch.reads or (patch.attr, )))


def is_applied(patch: Patch) -> bool:
    return patch in _applied


def _apply(module, patch: Patch) -> None:
    if patch in _applied:
        return
    if upstream_digest(patch) != patch.digest:
        warnings.warn(f"deepspeed_xla: {patch.module}.{patch.owner}.{patch.attr} differs from {patch.distribution} "
                      f"{VERSIONS[patch.distribution]}; patched anyway, re-check deepspeed_xla/patches/ against this "
                      f"{patch.distribution}.")
    owner = _owner(patch)
    setattr(owner, patch.attr, patch.wrapper(getattr(owner, patch.attr, None)))
    _applied.add(patch)
