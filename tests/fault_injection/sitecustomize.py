"""Test-only: one rank dies while writing a chosen checkpoint file.

Put this folder on PYTHONPATH and set DSX_TEST_DIE_SAVING="<rank>:<path part>": the worker with that
RANK sleeps DSX_TEST_DIE_AFTER seconds (default 3: its peers finish their own files meanwhile) in the
``torch.save`` of the first path containing <path part>, then kills itself with SIGKILL.
"""
import os
import signal
import time

_SPEC = os.environ.get("DSX_TEST_DIE_SAVING", "")


def _install(part: str) -> None:
    import torch
    save = torch.save

    def save_or_die(obj, f, *args, **kwargs):
        if part in str(f):
            print(f"DYING while saving {f}", flush=True)
            time.sleep(float(os.environ.get("DSX_TEST_DIE_AFTER", "3")))
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *args, **kwargs)

    torch.save = save_or_die


if _SPEC and os.environ.get("RANK") == _SPEC.split(":", 1)[0]:
    _install(_SPEC.split(":", 1)[1])
