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
import re
import warnings
from typing import Callable, Dict, List, NamedTuple, Tuple

WRITTEN_FOR = "0.19.8"
#: The release of each patched distribution the wrappers were written for, where one release is supported.
VERSIONS = {"deepspeed": WRITTEN_FOR, "torch": "2.9.0", "torch_xla": "2.9.0"}
#: The lowest and the highest release of each Hugging Face distribution the patches are tested with
#: (tests/launched/test_huggingface.py on the highest, test_huggingface_oldest.py on the lowest); setup.py's ``hf``
#: extra and ``ds_xla_report`` are made from it. peft and kernels are not patched: kernels is what transformers 5.25
#: requires (older transformers releases leave it unused), peft what the LoRA runs train with.
SUPPORTED = {"transformers": ("5.23.0", "5.25.0"), "accelerate": ("1.15.0", "1.16.0"), "peft": ("0.21.2", "0.21.2"),
             "kernels": ("0.19.1", "0.19.1")}
_DEEPSPEED_FILES = {
    "deepspeed.comm.comm": "50c3c19844feb343",
    "deepspeed.comm.torch": "e1ed1e77862a4048",
    "deepspeed.launcher.multinode_runner": "888fe4888604b4cd",
    "deepspeed.launcher.runner": "956d554ea5c9b142",
    "deepspeed.module_inject.layers": "759279bfa77043a6",
    "deepspeed.profiling.flops_profiler.profiler": "dc0e648289e4fd06",
    "deepspeed.runtime.bf16_optimizer": "12b5e15e30a6e4b4",
    "deepspeed.runtime.comm.coalesced_collectives": "7b545a32225b0315",
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
    "deepspeed.runtime.zero.partitioned_param_coordinator": "a43fd966c88dc369",
    "deepspeed.runtime.zero.stage3": "4ff3fdb4cbabaddf",
    "deepspeed.runtime.zero.stage_1_and_2": "752235af95d0de6f",
    "deepspeed.runtime.zero.utils": "3211114393b1a156",
    "deepspeed.utils.config": "3b897ee836bff115",
    "deepspeed.utils.nvtx": "1ca82972b9f95b35",
    "deepspeed.utils.timer": "222facbf73787d73",
}
#: sha256 prefix of each upstream file (by module) that defines code a patch reads, at each supported release
#: (``VERSIONS``, ``SUPPORTED``) where the file exists. A patch whose files all match one of them has the source one of
#: its digests was taken from, so every process start skips reading that source (``inspect.getsource`` tokenizes
#: each function and parses the whole file of a class).
UPSTREAM_FILES: Dict[str, Dict[str, str]] = {
    **{module: {WRITTEN_FOR: digest} for module, digest in _DEEPSPEED_FILES.items()},
    "torch._utils": {"2.9.0": "b52db634d2378395"},
    "accelerate.state": {"1.15.0": "8af1fe9a518f46bc", "1.16.0": "31c217fab2d921bd"},
    "accelerate.utils.deepspeed": {"1.15.0": "82dfa3c0ea4eb51b", "1.16.0": "82dfa3c0ea4eb51b"},
    "transformers.integrations.hub_kernels": {"5.25.0": "15077cc8e541f659"},
    "torch.nn.modules.linear": {"2.9.0": "63fb3cae2a1561fe"},
    "transformers.trainer": {"5.23.0": "da5a792ffed97570", "5.24.0": "87e1c73bc1263027", "5.25.0": "44ce713470a301ec"},
    "transformers.trainer_pt_utils": {release: "464c0711a0fd4260" for release in ("5.23.0", "5.24.0", "5.25.0")},
    "transformers.training_args": {"5.23.0": "fbdd5980f654c8c5", "5.24.0": "2dde33bfff94db1e",
                                   "5.25.0": "2dde33bfff94db1e"},
}


def release(version: str) -> Tuple[int, ...]:
    """``5.25.0`` -> ``(5, 25, 0)``: the numeric release, without a local tag or a pre-release suffix."""
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", version).group().split(".")[:3])


def supported(distribution: str) -> Tuple[str, str]:
    """The lowest and highest release of ``distribution`` the patches are tested with."""
    return SUPPORTED.get(distribution) or (VERSIONS[distribution], VERSIONS[distribution])


def releases(distribution: str) -> str:
    """The supported releases in words: ``5.23.0 to 5.25.0``, or the one release."""
    lowest, highest = supported(distribution)
    return lowest if lowest == highest else f"{lowest} to {highest}"


def requirement(distribution: str) -> str:
    """The pip requirement of the supported releases: ``transformers>=5.23.0,<=5.25.0``."""
    lowest, highest = supported(distribution)
    return f"{distribution}=={lowest}" if lowest == highest else f"{distribution}>={lowest},<={highest}"


def oldest_requirements() -> List[str]:
    """``name==lowest`` of each distribution whose lowest supported release is not its highest (what the smoke runs
    on the oldest releases install; scripts/run_tests.sh)."""
    return [f"{name}=={lowest}" for name, (lowest, highest) in SUPPORTED.items() if lowest != highest]


def in_range(distribution: str, version: str) -> bool:
    """Whether ``version`` lies between the lowest and the highest supported release, both included."""
    lowest, highest = supported(distribution)
    return release(lowest) <= release(version) <= release(highest)


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
    #: function using it; for a wrapper that re-implements a callee, both; a dotted name reaches a class through the
    #: module's imports (``timer.SynchronizedWallClockTimer.Timer``). The digest is of their sources.
    reads: Tuple[str, ...] = ()
    #: ``(release, digest)`` of each other supported release whose upstream source differs from ``digest``'s (which
    #: is at the highest release).
    digests_at: Tuple[Tuple[str, str], ...] = ()
    #: The first release that has ``attr`` as the wrapper expects it; older releases are not patched.
    since: str = ""
    #: The module whose load applies the patch, when not ``module``: torch's modules load before the startup hook can
    #: see them (it imports torch itself), so a DeepSpeed module that uses the patched code applies it.
    loaded_with: str = ""

    def applies_to(self, version: str) -> bool:
        """Whether this release of the distribution gets the patch (``since``)."""
        return not self.since or release(version) >= release(self.since)

    @property
    def hooked(self) -> str:
        """The module whose load applies the patch (the startup hook's ``_AFTER_IMPORT``)."""
        return self.loaded_with or self.module

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
    """The upstream function behind ``owner.name`` (a dotted name: through the attributes on the way), unwrapped; a
    property's getter."""
    *path, name = name.split(".")
    owner = functools.reduce(getattr, path, owner)
    declared = inspect.getattr_static(owner, name) if isinstance(owner, type) else None
    return unwrapped(declared.fget if isinstance(declared, property) else getattr(owner, name))


def unwrapped(function):
    """``inspect.unwrap``, also through DeepSpeed's ``instrument_w_nvtx``, which holds the function in its closure
    without ``functools.wraps``: the digest would be of nvtx.py's wrapper, the same whatever the method became."""
    function = inspect.unwrap(function)
    while getattr(function, "__qualname__", "") == "instrument_w_nvtx.<locals>.wrapped_fn":
        cells = dict(zip(function.__code__.co_freevars, function.__closure__))
        function = inspect.unwrap(cells["func"].cell_contents)
    return function


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
    """Whether every file holding the patch's upstream code is one ``UPSTREAM_FILES`` recorded."""
    return all(digest in UPSTREAM_FILES.get(module, {}).values() for module, digest in upstream_files(patch).items())


def changed(patch: Patch) -> bool:
    """Whether the installed upstream code the patch reads differs from that of every release it was checked on."""
    checked = {patch.digest, *dict(patch.digests_at).values()}
    return not _files_unchanged(patch) and upstream_digest(patch) not in checked


def label(patch: Patch) -> str:
    return ".".join(filter(None, (patch.module, patch.owner, patch.attr)))


def is_applied(patch: Patch) -> bool:
    return patch in _applied


def _apply(patch: Patch, warn: bool = True) -> bool:
    """Patch ``patch.module``; whether its upstream code ``changed`` (warned about unless ``warn`` is false)."""
    if patch in _applied:
        return False
    differs = changed(patch)
    if differs and warn:
        dist = patch.distribution
        warnings.warn(f"deepspeed_xla: {label(patch)} differs from {dist} {releases(dist)}; patched anyway, re-check "
                      f"deepspeed_xla/patches/ against this {dist}.")
    owner = _owner(patch)
    setattr(owner, patch.attr, patch.wrapper(getattr(owner, patch.attr, None)))
    _applied.add(patch)
    return differs
