"""torch_xla's StableHLO exporter waits for its first use in an XLA process, and a worker's start-up (torch_xla, a
DeepSpeed engine's modules) imports neither it nor torch's inductor."""
import ast
import json
from importlib import util

import pytest

from deepspeed_xla.patches import stablehlo
from tests.multiproc import run_python

START_UP = """
import json, sys
import torch_xla, deepspeed, deepspeed.runtime.engine, deepspeed.runtime.zero.muon.original_muon
loaded = {name: name in sys.modules for name in ("torch_xla._dynamo.dynamo_bridge", "torch._inductor.compile_fx")}
stand_in = sys.modules["torch_xla.stablehlo"]
options = torch_xla.stablehlo.StableHLOExportOptions  # any other name than the re-exported ones loads the module
real = sys.modules["torch_xla.stablehlo"]
real.save_as_stablehlo = lambda *args, **kwargs: ("saved", args, kwargs)
print(json.dumps({"loaded": loaded, "stand_in": type(stand_in).__name__, "real": type(real).__name__,
                  "attribute_is_real": torch_xla.stablehlo is real, "options": options.__module__,
                  "file": real.__file__ == stand_in.__file__,
                  "forwarded": torch_xla.save_as_stablehlo(1, to="x") if stand_in is not real else None}))
"""


def _start_up(**env) -> dict:
    proc = run_python(START_UP, **env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_xla_worker_start_up_defers_the_exporter():
    seen = _start_up(DS_ACCELERATOR="xla")
    assert seen["loaded"] == {"torch_xla._dynamo.dynamo_bridge": False, "torch._inductor.compile_fx": False}
    assert seen["stand_in"] == "_StandIn" and seen["real"] == "module" and seen["attribute_is_real"]
    assert seen["options"] == "torch_xla.stablehlo" and seen["file"]
    assert seen["forwarded"] == ["saved", [1], {"to": "x"}]


def test_other_processes_import_torch_xla_unchanged():
    seen = _start_up(DS_ACCELERATOR="cpu")
    assert seen["stand_in"] == seen["real"] == "module"
    assert seen["loaded"]["torch_xla._dynamo.dynamo_bridge"]


def test_stand_in_carries_what_torch_xla_imports_from_the_module():
    """Fails when torch_xla changes what its ``__init__`` takes from ``stablehlo``: a new name would load the module
    at import again (correct, only slower); update ``STAND_IN_NAMES``."""
    from importlib import metadata
    from deepspeed_xla import xla_runtime
    assert xla_runtime.base_version(metadata.version("torch_xla")) == stablehlo.VERSIONS["torch_xla"]
    tree = ast.parse(open(util.find_spec("torch_xla").origin).read())
    imported = [tuple(alias.name for alias in node.names) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "stablehlo" and node.level == 1]
    assert imported == [stablehlo.STAND_IN_NAMES]


def test_a_failed_load_keeps_the_stand_in(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, stablehlo.MODULE, stablehlo._stand_in)
    monkeypatch.setattr(stablehlo, "MODULE", "dsx_no_such_module")
    monkeypatch.setitem(sys.modules, "dsx_no_such_module", stablehlo._stand_in)
    with pytest.raises(ModuleNotFoundError):
        stablehlo._stand_in.anything
    assert sys.modules["dsx_no_such_module"] is stablehlo._stand_in


def test_the_loading_module_may_read_the_stand_in(tmp_path, monkeypatch):
    """While the real module's body runs, the package attribute still names the stand-in: reading through it
    answers from the loading module instead of waiting for its own load."""
    import sys
    import threading
    (tmp_path / "dsx_reentrant.py").write_text(
        "value = 1\nfrom deepspeed_xla.patches import stablehlo\nseen = stablehlo._stand_in.value + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(stablehlo, "MODULE", "dsx_reentrant")
    monkeypatch.setitem(sys.modules, "dsx_reentrant", stablehlo._stand_in)
    answer = []
    reader = threading.Thread(target=lambda: answer.append(stablehlo._stand_in.seen), daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert answer == [2]
    assert sys.modules["dsx_reentrant"].__name__ == "dsx_reentrant"
