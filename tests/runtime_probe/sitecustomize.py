"""Test-only: on exit, every Python process records whether it started the XLA runtime.

Put this folder on PYTHONPATH and set DSX_TEST_RUNTIME_LOG to a file; one JSON line per process.
"""
import atexit
import json
import os
import sys


def _record():
    module = sys.modules.get("torch_xla")
    started = bool(module is not None and module._XLAC._xla_runtime_is_initialized())
    with open(os.environ["DSX_TEST_RUNTIME_LOG"], "a") as handle:
        handle.write(json.dumps({"argv": sys.argv, "torch_xla_imported": module is not None,
                                 "runtime_started": started}) + "\n")


if os.environ.get("DSX_TEST_RUNTIME_LOG"):
    atexit.register(_record)
