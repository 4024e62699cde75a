"""Run one function in N processes that form a torch.distributed world (env:// rendezvous)."""
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

from tests.conftest import REPO, clean_env
from tests.launch import free_port


def run_ranks(target: str, world_size: int, env: Optional[dict] = None,
              timeout: float = 240) -> List[subprocess.CompletedProcess]:
    """Call ``target`` ("module:function", importable from the repo root) once per rank.

    Output goes to files, not pipes: a rank blocked on a full pipe would stall its peers. On timeout
    every rank is killed and its stderr says so, so a hang fails the test instead of blocking it.
    """
    module, function = target.split(":")
    code = f"import importlib; importlib.import_module({module!r}).{function}()"
    port = free_port()
    deadline = time.monotonic() + timeout
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = clean_env(RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world_size,
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **(env or {}))
        rank_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), rank_env.get("PYTHONPATH")]))
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        logs.append((out, err))
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=rank_env, stdout=out, stderr=err))
    results = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, logs)):
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
            note = ""
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            proc.wait()
            note = f"\n[rank {rank} killed: the ranks did not finish within {timeout:.0f} s]"
        out.seek(0)
        err.seek(0)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read() + note))
        out.close()
        err.close()
    return results
