"""The per-process setup: its checks that need no second process, and the compilation cache it sets up."""
import json

import pytest
import torch

from deepspeed_xla import process_setup
from tests.multiproc import run_python


def test_rank_and_xla_ordinal_must_agree(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(process_setup.xla_runtime, "global_ordinal", lambda: 3)
    process_setup._check_ordinal()
    monkeypatch.setattr(process_setup.xla_runtime, "global_ordinal", lambda: 5)
    with pytest.raises(RuntimeError, match=r"RANK=3 but XLA global ordinal 5: .* hostfile in TPU worker-id order"):
        process_setup._check_ordinal()


def test_each_rank_has_its_own_compilation_cache_folder():
    assert process_setup.compilation_cache_dir({}) is None
    assert process_setup.compilation_cache_dir({"DS_XLA_COMPILATION_CACHE": "/cache", "RANK": "3"}) == "/cache/rank3"
    assert process_setup.compilation_cache_dir({"DS_XLA_COMPILATION_CACHE": "/cache"}) == "/cache/rank0"


CACHE_PROBE = """
import json, torch, deepspeed
import torch_xla.debug.metrics as met
device = deepspeed.get_accelerator().current_device_name()
x = torch.arange(16.0, device=device).reshape(4, 4)
value = (x @ x).sum().item()
print(json.dumps({"value": value, "counters": {name: met.counter_value(name) for name in met.counter_names()
                                               if name.startswith("PersistentCache")}}))
"""


def test_a_second_run_looks_up_what_the_first_compiled(tmp_path):
    """PJRT CPU writes and finds the entries but cannot load them ("Deserializing serialized executable not
    supported") and compiles again; on TPU the lookup is a hit and nothing compiles (docs/tpu_pods.md)."""
    runs = []
    for _ in range(2):
        proc = run_python(CACHE_PROBE, DS_ACCELERATOR="xla", DS_XLA_COMPILATION_CACHE=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    x = torch.arange(16.0).reshape(4, 4)
    assert first["value"] == second["value"] == float((x @ x).sum())
    entries = list((tmp_path / "rank0").iterdir())
    assert entries and first["counters"] == {"PersistentCacheMiss": len(entries)}, (entries, first)
    assert second["counters"] == {"PersistentCacheDeserializeFailure": len(entries)}, second  # found, not loadable
