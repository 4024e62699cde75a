"""gloo's connection lines (``comm/gloo_output``): held back while a group connects, whole and by rank with
``DS_XLA_VERBOSE=1``. Real groups of several ranks: ``test_host_staged.py``'s runs; the main job's output:
``tests/launched/test_docs.py``."""
import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from deepspeed_xla.comm import gloo_output, host_staged
from tests.conftest import REPO
from tests.multiproc import run_python


def _one_rank_group(lazy: bool) -> None:
    host_staged._gloo_group(dist.HashStore(), 0, 1, timedelta(seconds=30), lazy)


@pytest.mark.parametrize("lazy", [False, True], ids=["connected", "lazy"])
def test_a_group_connects_quietly_and_verbose_brings_gloo_lines_back_by_rank(capfd, monkeypatch, lazy):
    """The reference: what gloo itself prints for the same group of one, built without deepspeed_xla."""
    monkeypatch.delenv(gloo_output.VERBOSE_ENV, raising=False)
    dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
    reference = capfd.readouterr().out
    assert reference.startswith("[Gloo] Rank 0 is connected to 0 peer ranks"), reference
    _one_rank_group(lazy)
    assert capfd.readouterr().out == ""
    monkeypatch.setenv(gloo_output.VERBOSE_ENV, "1")
    monkeypatch.setenv("RANK", "5")  # a launched process is named by its global rank, not its rank in the group
    monkeypatch.setenv("WORLD_SIZE", "8")
    _one_rank_group(lazy)
    assert capfd.readouterr().out == f"[rank 5] {reference}"


def test_what_else_is_written_meanwhile_is_kept_as_it_was(capfd, monkeypatch):
    monkeypatch.delenv(gloo_output.VERBOSE_ENV, raising=False)
    with gloo_output.held_back(0):
        os.write(1, b"[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0\n")
        print("another thread's line", flush=True)
    assert capfd.readouterr().out == "another thread's line\n"


def test_a_bad_switch_names_the_fix_before_the_group_connects(monkeypatch):
    monkeypatch.setenv(gloo_output.VERBOSE_ENV, "yes")
    with pytest.raises(ValueError, match=r"DS_XLA_VERBOSE='yes' is not an integer: set it to 1 \(on\) or 0 \(off\)"):
        with gloo_output.held_back(0):
            pytest.fail("held_back ran its body with a bad switch")


def test_a_process_without_stdout_connects_its_groups():
    """A daemon may have closed descriptor 1: there is nothing to hold back then, and no reason to fail."""
    code = ("import os, sys\nos.close(1)\nfrom deepspeed_xla.comm import gloo_output\n"
            "with gloo_output.held_back(0):\n    sys.stderr.write('connected')\n")
    proc = run_python(code, cwd=REPO)
    assert (proc.returncode, proc.stderr) == (0, "connected"), proc.stderr
