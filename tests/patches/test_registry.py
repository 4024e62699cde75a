"""How a patch is checked against upstream: a file ``registry.UPSTREAM_FILES`` recorded spares reading the source;
any other file is checked by the source digest, which alone decides the warning."""
import importlib.util
import sys
import warnings

import pytest

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
    monkeypatch.setitem(registry.VERSIONS, name, "1.0")
    return module


def _apply(module, digest: str) -> list:
    """Apply a patch of ``module.f`` written against ``digest``; the warnings it gave."""
    patch, upstream = Patch(module.__name__, "", "f", lambda f: (lambda: f() + 1), digest), module.f()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry._apply(module, patch)
    assert registry.is_applied(patch) and module.f() == upstream + 1  # patched either way
    return [str(warning.message) for warning in caught]


def test_a_recorded_file_is_not_read(tmp_path, monkeypatch):
    module = _upstream(tmp_path, monkeypatch, UPSTREAM)
    digest = registry.source_digest(module.f)
    monkeypatch.setitem(registry.UPSTREAM_FILES, module.__name__, registry.file_digest(module.__file__))
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
    assert all(f"{module.__name__}..f differs from {module.__name__} 1.0" in message for message in warned)
