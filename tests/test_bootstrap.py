"""The startup hook: every interpreter honours DS_ACCELERATOR=xla, and the hook itself costs ~nothing."""
import json
import subprocess
import sys

import pytest

from tests.conftest import clean_env
from tests.multiproc import run_command, run_python


def _python(code: str, **env) -> subprocess.CompletedProcess:
    proc = run_python(code, **env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


PROBE = """
import json, sys, deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.accelerator.real_accelerator import is_current_accelerator_supported
from deepspeed.ops.op_builder import FusedAdamBuilder
from deepspeed.ops.adam import fused_adam
from deepspeed_xla.xla_runtime import is_runtime_initialized
# device_count() first: the host's devices, before device_name() prepares this process to drive one of them
print(json.dumps({"device_count": get_accelerator().device_count(), "name": get_accelerator().device_name(),
                  "cls": type(get_accelerator()).__module__,
                  "supported": is_current_accelerator_supported(), "builder": FusedAdamBuilder.__module__,
                  "fused_adam_builder": fused_adam.FusedAdamBuilder.__module__,
                  "runtime_initialized": is_runtime_initialized()}))
"""


def _probe(**env) -> dict:
    return json.loads(_python(PROBE, **env).stdout.strip().splitlines()[-1])


def test_ds_accelerator_xla_selects_our_accelerator_at_import():
    info = _probe(DS_ACCELERATOR="xla")
    assert info["name"] == "xla"
    assert info["cls"] == "deepspeed_xla.accelerator"
    assert info["supported"] is True
    assert info["builder"] == info["fused_adam_builder"] == "deepspeed_xla.op_builder.fused_adam"


def test_device_count_leaves_runtime_uninitialized():
    info = _probe(DS_ACCELERATOR="xla", CPU_NUM_DEVICES=3)
    assert info["device_count"] == 3
    assert info["runtime_initialized"] is False


def test_unset_ds_accelerator_on_a_host_without_tpu_keeps_deepspeed_default():
    info = _probe(DS_ACCELERATOR=None)
    assert info["name"] == "cpu"


def test_hook_imports_neither_torch_nor_deepspeed_and_is_cheap():
    proc = _python("import sys, json; print(json.dumps(sorted(m for m in ('torch', 'deepspeed', 'torch_xla') "
                   "if m in sys.modules)))", DS_ACCELERATOR="xla")
    assert json.loads(proc.stdout) == []
    costs = []
    for _ in range(3):
        trace = run_command([sys.executable, "-X", "importtime", "-c", "pass"], 60,
                            env=clean_env(DS_ACCELERATOR="xla")).stderr
        hook = [line for line in trace.splitlines() if line.split("|")[-1].strip().startswith("deepspeed_xla")]
        assert any(line.rstrip().endswith("deepspeed_xla.bootstrap") for line in hook), "hook did not run:\n" + trace
        costs.append(sum(int(line.split("|")[1]) for line in hook))  # cumulative microseconds
    assert min(costs) < 20_000, costs


def test_explicit_register_after_import():
    code = ("import warnings, deepspeed, deepspeed_xla\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    deepspeed_xla.register()\n"
            "print(get_accelerator().device_name(), any('after `import deepspeed`' in str(x.message) for x in w))")
    out = _python(code, DS_ACCELERATOR=None).stdout.split()
    assert out[-2:] == ["xla", "True"]


FROZEN = """
import gc, json
import torch_xla, deepspeed
print(json.dumps({"frozen": gc.get_freeze_count(), "enabled": gc.isenabled(), "left": len(gc.get_objects())}))
"""


def test_frameworks_import_with_the_collector_paused_then_frozen():
    """torch, torch_xla and DeepSpeed's module objects live until exit: frozen, no collection walks them again."""
    hooked = json.loads(_python(FROZEN).stdout.strip().splitlines()[-1])
    plain = json.loads(_python(FROZEN, DS_XLA_DISABLE_HOOK="1").stdout.strip().splitlines()[-1])
    assert plain["frozen"] == 0 and plain["enabled"]
    assert hooked["enabled"], "the collector stays on after the imports"
    assert hooked["frozen"] > 10 * hooked["left"], hooked  # what the frameworks built is all frozen
    assert hooked["frozen"] + hooked["left"] > plain["left"] / 2, (hooked, plain)


def test_a_failing_frozen_import_leaves_the_collector_on(tmp_path, monkeypatch):
    from deepspeed_xla import bootstrap
    (tmp_path / "dsx_broken_framework.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bootstrap, "_FROZEN_IMPORTS", bootstrap._FROZEN_IMPORTS + ("dsx_broken_framework",))
    bootstrap.install()
    assert bootstrap.is_active()
    import gc
    frozen = gc.get_freeze_count()
    with pytest.raises(RuntimeError, match="broken at import"):
        import dsx_broken_framework  # noqa: F401
    assert gc.isenabled() and gc.get_freeze_count() > frozen


def test_a_secret_file_that_cannot_be_read_is_said_and_leaves_no_secret(tmp_path):
    """The ranks then stop at their first process group (comm/test_authentication.py): here, only what is said."""
    proc = _python("import os; print(os.environ.get('DS_XLA_JOB_SECRET'), 'DS_XLA_JOB_SECRET_FILE' in os.environ)",
                   DS_XLA_JOB_SECRET_FILE=str(tmp_path / "gone"))
    assert proc.stdout.split() == ["None", "False"]
    assert f"cannot read this job's DS_XLA_JOB_SECRET from {tmp_path / 'gone'}" in proc.stderr, proc.stderr
