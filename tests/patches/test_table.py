"""Every run-time patch of DeepSpeed (and of the Hugging Face libraries around it) still matches the upstream code it
was written for, at the installed releases (CI installs the newest supported ones; the oldest are checked by
``tests/launched/test_huggingface_oldest.py`` with ``files_as_recorded``)."""
import importlib
from importlib import metadata
from pathlib import Path
from typing import Dict, Tuple

import pytest

from deepspeed_xla import bootstrap, patches
from deepspeed_xla.patches import registry

REQUIREMENTS = Path(__file__).resolve().parents[2] / "requirements.txt"


def test_written_for_the_installed_deepspeed():
    assert metadata.version("deepspeed") == patches.WRITTEN_FOR


def test_requirements_pin_the_highest_supported_releases():
    pins = dict(line.split("==") for line in REQUIREMENTS.read_text().splitlines() if "==" in line)
    assert {name: pins.get(name) for name in registry.SUPPORTED} == {
        name: highest for name, (_, highest) in registry.SUPPORTED.items()}


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: f"{p.module}.{p.owner}.{p.attr}")
def test_patched_upstream_source_unchanged(patch):
    """Each patch is applied (a patch ``since`` a later release than the installed one is not) and its upstream source
    has the digest the table records at the installed release."""
    release = metadata.version(patch.distribution)
    importlib.import_module(patch.module)
    assert patches.is_applied(patch) == patch.applies_to(release), "patch (not) applied under DS_ACCELERATOR=xla"
    assert not patch.applies_to(release) or patches.upstream_digest(patch) == dict(patch.digests_at).get(
        release, patch.digest), (
        f"{patch.distribution} changed {patch.module}.{patch.owner}.{patch.attr}: re-check the patch in "
        "deepspeed_xla/patches/")


def test_startup_hook_covers_every_patched_module():
    hooked = {name for name, hook in bootstrap._AFTER_IMPORT.items() if hook == bootstrap._PATCHES_HOOK}
    assert hooked == set(patches.PATCHED_MODULES)


def files_as_recorded() -> Tuple[Dict[str, str], Dict[str, str]]:
    """(installed, recorded): the digest of each file holding code a patch that applies to the installed release
    reads, and ``registry.UPSTREAM_FILES``' digest of that file at that release; and the same for the source digest
    of each such patch (by its label) against the table's digest at that release."""
    installed, recorded = {}, {}
    for patch in patches.PATCHES:
        release = metadata.version(patch.distribution)
        if not patch.applies_to(release):
            continue
        importlib.import_module(patch.module)
        for module, digest in registry.upstream_files(patch).items():
            installed[module], recorded[module] = digest, registry.UPSTREAM_FILES.get(module, {}).get(release)
        key = f"{registry.label(patch)} {patch.wrapper.__name__}"
        installed[key] = patches.upstream_digest(patch)
        recorded[key] = dict(patch.digests_at).get(release, patch.digest)
    return installed, recorded


def test_upstream_files_are_the_ones_recorded():
    """``registry.UPSTREAM_FILES`` names every file holding code a patch reads, with the installed file's digest at
    the installed release; a new release fails here until the patches are re-checked and the table updated."""
    installed, recorded = files_as_recorded()
    assert installed == recorded
    at_installed = {module for module, digests in registry.UPSTREAM_FILES.items()
                    if metadata.version(module.split(".")[0]) in digests}
    assert {name for name in installed if " " not in name} == at_installed


def test_a_method_deepspeed_wraps_for_nvtx_is_digested_itself():
    """``instrument_w_nvtx`` holds the method in its closure without ``functools.wraps``: a digest of its wrapper
    (nvtx.py's ``wrapped_fn``) stayed the same whatever DeepSpeed did to the method, so a change went unseen."""
    from deepspeed_xla.patches import zero
    for patch in patches.PATCHES:
        if patch.applies_to(metadata.version(patch.distribution)):
            importlib.import_module(patch.module)
            assert all(code.__qualname__ != "instrument_w_nvtx.<locals>.wrapped_fn"
                       for code in registry.upstream_code(patch)), registry.label(patch)
    (norm, ) = [patch for patch in patches.PATCHES if patch.wrapper is zero.stage3_grad_norm]
    assert registry.upstream_code(norm)[0].__qualname__ == "DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct"
