"""Ranks of one function (env:// rendezvous), forked from a ``tests/fork_server.py`` that imported torch once for
the session."""
import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from deepspeed_xla.launch_env import free_port
from tests.conftest import REPO, clean_env
from tests.multiproc.commands import kill_group, remove_cpu_comm_buffers, start_command


# Variables read only after start-up and after a fork server's imports: ranks whose environments differ only in these
# (and in those a caller of ``start_ranks`` names) fork from one ``tests/fork_server.py``. The launcher's, DeepSpeed's
# (read when deepspeed is imported, which only the CPU accelerator's server does, with its DS_ACCELERATOR) and HOME
# (``clean_env`` makes one per process), pytest's PYTEST_CURRENT_TEST. Not the test fixtures' ``DSX_TEST_*``: their
# ``sitecustomize.py`` reads them at start-up.
_AFTER_IMPORT = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "HOME", "DS_ACCELERATOR", "DS_XLA_COMM_TIMEOUT", "DS_XLA_HEARTBEAT_TIMEOUT", "PYTEST_CURRENT_TEST"}
FORK_SERVER = REPO / "tests" / "fork_server.py"


class _ForkedRank:
    """What the tests use of a ``subprocess.Popen`` (``args``, ``pid``, ``poll``, ``wait``, ``returncode``), for a
    rank that a fork server started. It leads its own session, so ``kill_group`` ends it as it ends a command."""

    def __init__(self, args: list, pid: int, server: "_ForkServer"):
        self.args, self.pid, self.returncode, self._server = args, pid, None, server

    def poll(self) -> Optional[int]:
        self.returncode = self._server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self.returncode = self._server.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class _ForkServer:
    """One ``tests/fork_server.py`` and the socket to it; the exit codes of its ranks as it reports them."""

    def __init__(self, env: dict, modules: Sequence[str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile("w+")
        self._proc = start_command([sys.executable, str(FORK_SERVER), str(theirs.fileno()), *modules], cwd=REPO,
                                   env=env, pass_fds=(theirs.fileno(), ), stdin=subprocess.DEVNULL,
                                   stdout=self._log, stderr=subprocess.STDOUT)
        theirs.close()
        self._channel, self._lock, self._changed = ours, threading.Lock(), threading.Condition()
        self._pids: List[int] = []
        self._codes: Dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while message := self._channel.recv(4096):
            reply = json.loads(message)
            with self._changed:
                if "code" in reply:
                    self._codes[reply["pid"]] = reply["code"]
                else:
                    self._pids.append(reply["pid"])
                self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()

    def _wait_for(self, ready, timeout: Optional[float]) -> None:
        with self._changed:
            self._changed.wait_for(lambda: ready() or self._gone, timeout)
            if not ready() and self._gone:
                self._log.seek(0)
                raise RuntimeError(f"tests/fork_server.py ended ({self._proc.wait()}):\n{self._log.read()[-6000:]}")

    def start(self, code: str, env: dict, out, err) -> _ForkedRank:
        """Fork a rank that runs ``python -c code`` in ``env`` (cwd: the repository), writing to files ``out``,
        ``err``."""
        with self._lock:
            socket.send_fds(self._channel, [json.dumps({"env": env, "cwd": str(REPO), "code": code}).encode()],
                            [out.fileno(), err.fileno()])
            self._wait_for(lambda: self._pids, timeout=120)
            with self._changed:
                pid = self._pids.pop()
        return _ForkedRank([sys.executable, "-c", code], pid, self)

    def exit_code(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        self._wait_for(lambda: pid in self._codes, timeout)
        return self._codes.get(pid)

    def close(self) -> None:
        self._channel.close()
        kill_group(self._proc)


_SERVERS: Dict[str, _ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def _fork_server(env: dict, after_import: Sequence[str]) -> _ForkServer:
    """The session's fork server for ranks with this environment (started on first use). DeepSpeed's CPU accelerator
    never imports torch_xla, whose import patches torch (``nn.GRU``, ``clip_grad_norm_``): its ranks get a server
    that imported torch and DeepSpeed instead, with the Muon optimizer every engine imports (its torch.compile'd
    kernels bring in dynamo and inductor)."""
    cpu = env.get("DS_ACCELERATOR") == "cpu"
    base = {k: v for k, v in env.items()
            if (k not in _AFTER_IMPORT or cpu and k == "DS_ACCELERATOR") and k not in after_import}
    modules = ("torch", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer") if cpu else ("torch", "torch_xla")
    key = json.dumps([base, modules], sort_keys=True)
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            _SERVERS[key] = _ForkServer(base, modules)
        return _SERVERS[key]


@atexit.register
def _close_fork_servers() -> None:
    for server in _SERVERS.values():
        server.close()


def start_ranks(target: str, world_size: int, env: Optional[dict] = None,
                after_import: Sequence[str] = (), args: Sequence[str] = ()) -> Tuple[list, list]:
    """Start ``target`` ("module:function", importable from the repo root) once per rank, env:// rendezvous; each
    rank as ``python -c`` would run it (``args`` in its ``sys.argv``), forked from a ``tests/fork_server.py`` that
    has imported torch and torch_xla (DeepSpeed, for its CPU accelerator) once for the session.

    Returns the processes (each in its own session: ``kill_group`` ends it) and their (stdout, stderr) files:
    files, not pipes, since a rank blocked on a full pipe would stall its peers. ``env`` may set ``MASTER_PORT``
    (to find the run's files afterwards). ``after_import``: variables of ``env`` that only ``target`` reads, which
    another run's ranks may set otherwise and still share their fork server.
    """
    module, function = target.split(":")
    code = (f"import importlib, sys; sys.argv[1:] = {list(map(str, args))!r}; "
            f"importlib.import_module({module!r}).{function}()")
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = clean_env(**{"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank,
                                "LOCAL_WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                **(env or {})})
        rank_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), rank_env.get("PYTHONPATH")]))
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        logs.append((out, err))
        procs.append(_fork_server(rank_env, after_import).start(code, rank_env, out, err))
    return procs, logs


def run_ranks(target: str, world_size: int, env: Optional[dict] = None, timeout: float = 240,
              after_import: Sequence[str] = (), args: Sequence[str] = ()) -> List[subprocess.CompletedProcess]:
    """Call ``target`` once per rank (see ``start_ranks``) and wait for all of them.

    On timeout every rank is killed and its stderr says so, so a hang fails the test instead of blocking it.
    """
    deadline = time.monotonic() + timeout
    env = {"MASTER_PORT": free_port(), **(env or {})}
    try:
        return _wait_for_ranks(*start_ranks(target, world_size, env, after_import, args), deadline, timeout)
    finally:
        remove_cpu_comm_buffers(str(env["MASTER_PORT"]))


def _wait_for_ranks(procs: list, logs: list, deadline: float, timeout: float) -> List[subprocess.CompletedProcess]:
    results = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, logs)):
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
            note = ""
        except subprocess.TimeoutExpired:
            for other in procs:
                kill_group(other)
            note = f"\n[rank {rank} killed: the ranks did not finish within {timeout:.0f} s]"
        kill_group(proc)
        out.seek(0)
        err.seek(0)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read() + note))
        out.close()
        err.close()
    return results
