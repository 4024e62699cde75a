"""How a patch is checked against upstream: a file ``registry.UPSTREAM_FILES`` recorded spares reading the source;
any other file is checked by the source digests (one per supported release where it differs), which alone decide the
warning; a release outside the supported range gets one line naming the range and what changed."""
import importlib.util
import sys
import warnings

import pytest

from deepspeed_xla import patches
from deepspeed_xla.patches import registry
from deepspeed_xla.patches.registry import Patch

UPSTREAM = "def f():\n    return 1\n"


def _upstream(tmp_path, monkeypatch, source: str, name: str = "dsx_upstream"):
    """A module standing for an upstream file, its own distribution at release 1.0 (both undone after the test)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    module.__spec__.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(registry.SUPPORTED, name, ("1.0", "2.0"))
    return module


def _plus_one():
    """A wrapper adding one to what the upstream function returns; a new one for each patch (``Patch`` is a value: an
    equal patch of another test's module would count as applied)."""
    return lambda f: (lambda: f() + 1)


def _warnings(call, *args) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(*args)
    return [str(warning.message) for warning in caught]


def _apply(module, digest: str, digests_at=()) -> list:
    """Apply a patch of ``module.f`` written against ``digest``; the warnings it gave."""
    patch, upstream = Patch(module.__name__, "", "f", _plus_one(), digest, digests_at=digests_at), module.f()
    warned = _warnings(registry._apply, patch)
    assert registry.is_applied(patch) and module.f() == upstream + 1  # patched either way
    return warned


def test_a_recorded_file_is_not_read(tmp_path, monkeypatch):
    module = _upstream(tmp_path, monkeypatch, UPSTREAM)
    digest = registry.source_digest(module.f)
    monkeypatch.setitem(registry.UPSTREAM_FILES, module.__name__, {"1.0": registry.file_digest(module.__file__)})
    monkeypatch.setattr(registry, "source_digest", pytest.fail)
    assert _apply(module, digest) == []


@pytest.mark.parametrize("function_changed", [False, True])
def test_another_file_warns_only_when_the_function_changed(tmp_path, monkeypatch, function_changed):
    """The file differs from any recorded one (a comment added elsewhere, or a changed ``f``)."""
    written_for = registry.source_digest(_upstream(tmp_path, monkeypatch, UPSTREAM, "dsx_written_for").f)
    changed = UPSTREAM.replace("1", "3") if function_changed else UPSTREAM
    module = _upstream(tmp_path, monkeypatch, f"# another release\n{changed}")
    warned = _apply(module, written_for)
    assert len(warned) == function_changed
    assert all(f"{module.__name__}.f differs from {module.__name__} 1.0 to 2.0" in message for message in warned)


def test_the_digest_of_another_supported_release_is_no_change(tmp_path, monkeypatch):
    """The installed ``f`` is release 1.0's, recorded in ``digests_at``; ``digest`` (release 2.0's) differs."""
    older = registry.source_digest(_upstream(tmp_path, monkeypatch, UPSTREAM, "dsx_older").f)
    module = _upstream(tmp_path, monkeypatch, f"# release 1.0\n{UPSTREAM}")
    assert _apply(module, "0" * 16, digests_at=(("1.0", older), )) == []


def _load(module, monkeypatch, version: str, *table: Patch) -> list:
    """``on_module_loaded(module)`` with ``table`` as the patch table and ``version`` installed; its warnings."""
    monkeypatch.setattr(patches, "PATCHES", list(table))
    monkeypatch.setattr(patches.metadata, "version", lambda name: version if name == module.__name__ else None)
    return _warnings(patches.on_module_loaded, module)


def test_a_release_outside_the_range_gets_one_line_naming_it(tmp_path, monkeypatch):
    """Release 3.0 of a distribution supported from 1.0 to 2.0: one warning, with the range and the one patched
    function that changed (``f``; ``g`` is as recorded); both are patched. Inside the range, nothing is said."""
    written_for = _upstream(tmp_path, monkeypatch, UPSTREAM + "def g():\n    return 2\n", "dsx_written_for")
    module = _upstream(tmp_path, monkeypatch, UPSTREAM.replace("1", "3") + "def g():\n    return 2\n")
    table = [Patch(module.__name__, "", name, _plus_one(), registry.source_digest(getattr(written_for, name)))
             for name in ("f", "g")]
    monkeypatch.setattr(patches, "_REPORTED", set())
    assert _load(module, monkeypatch, "3.0", *table) == [
        f"deepspeed_xla: {module.__name__} 3.0 is outside the releases its patches are tested with (1.0 to 2.0; pip "
        f"install '{module.__name__}>=1.0,<=2.0'). Of the functions it patches (checked as each module loads), "
        f"changed: {module.__name__}.f."]
    assert (module.f(), module.g()) == (4, 3)
    inside = _upstream(tmp_path, monkeypatch, UPSTREAM, "dsx_inside")
    assert _load(inside, monkeypatch, "1.5", Patch(inside.__name__, "", "f", _plus_one(), table[0].digest)) == []
    assert inside.f() == 2


def test_a_patch_since_a_later_release_leaves_older_ones_alone(tmp_path, monkeypatch):
    module = _upstream(tmp_path, monkeypatch, UPSTREAM)
    patch = Patch(module.__name__, "", "f", _plus_one(), registry.source_digest(module.f), since="1.5")
    assert _load(module, monkeypatch, "1.0", patch) == [] and module.f() == 1 and not registry.is_applied(patch)
    assert _load(module, monkeypatch, "2.0", patch) == [] and module.f() == 2
