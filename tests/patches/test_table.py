"""Every run-time patch of DeepSpeed still matches the upstream code it was written for."""
import importlib
from importlib import metadata

import pytest

from deepspeed_xla import bootstrap, patches
from deepspeed_xla.patches import registry


def test_written_for_the_installed_deepspeed():
    assert metadata.version("deepspeed") == patches.WRITTEN_FOR


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: f"{p.module}.{p.owner}.{p.attr}")
def test_patched_upstream_source_unchanged(patch):
    importlib.import_module(patch.module)
    assert patches.is_applied(patch), "patch not applied under DS_ACCELERATOR=xla"
    assert patches.upstream_digest(patch) == patch.digest, (
        f"DeepSpeed changed {patch.module}.{patch.owner}.{patch.attr}: re-check the patch in deepspeed_xla/patches/")


def test_startup_hook_covers_every_patched_module():
    hooked = {name for name, hook in bootstrap._AFTER_IMPORT.items() if hook == bootstrap._PATCHES_HOOK}
    assert hooked == set(patches.PATCHED_MODULES)


def test_upstream_files_are_the_ones_recorded():
    """``registry.UPSTREAM_FILES`` names every file holding code a patch reads, with the installed file's digest; a new
    release fails here until the patches are re-checked and the table updated."""
    installed = {module: digest
                 for patch in patches.PATCHES for module, digest in registry.upstream_files(patch).items()}
    assert installed == registry.UPSTREAM_FILES
