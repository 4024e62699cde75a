"""Multi-process helpers: launching commands in their own session, N ranks of one function (env:// rendezvous),
``scripts/train.py`` through the real ``deepspeed`` CLI with its losses and weights read back (each distinct run
once per session), and the comparison of two such runs."""
import atexit
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from deepspeed_xla.launch_env import free_port
from tests.conftest import FAST_COMPILE, REPO, VENV_BIN, clean_env

T = TypeVar("T")
K = TypeVar("K")


def start_command(cmd, **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` in a new session: the command and everything it starts (the deepspeed runner, its
    launcher, the workers) form one process group, which ``kill_group`` ends."""
    return subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``start_command`` started (what is left of it), then reap its leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group has already exited
    proc.wait()


def run_command(cmd, timeout: float, *, input: Optional[str] = None, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)``, started by ``start_command``.

    On timeout the whole process group is killed before ``TimeoutExpired`` is raised (``subprocess.run`` kills
    only the command itself, leaving a launcher's workers running); after a normal exit, anything the command
    left behind in its group is killed too.
    """
    proc = start_command(cmd, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_python(code: str, *args: str, cwd=None, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """``python -c code args`` in ``clean_env(**env)``, through ``run_command``."""
    return run_command([sys.executable, "-c", code, *args], timeout, cwd=cwd, env=clean_env(**env))


def last_error(proc: subprocess.CompletedProcess) -> str:
    """The last line of a failed command's stderr: where Python and the deepspeed runner put the error."""
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc.stderr.strip().splitlines()[-1]


# Variables read only after start-up and after a fork server's imports: ranks whose environments differ only in these
# (and in those a caller of ``start_ranks`` names) fork from one ``tests/fork_server.py``. The launcher's, DeepSpeed's
# (read when deepspeed is imported, which only the CPU accelerator's server does, with its DS_ACCELERATOR) and HOME
# (``clean_env`` makes one per process), pytest's PYTEST_CURRENT_TEST. Not the test fixtures' ``DSX_TEST_*``: their
# ``sitecustomize.py`` reads them at start-up.
_AFTER_IMPORT = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "HOME", "DS_ACCELERATOR", "DS_XLA_COMM_TIMEOUT", "PYTEST_CURRENT_TEST"}
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
    procs, logs = start_ranks(target, world_size, env, after_import, args)
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


def run_jobs(jobs: Dict[K, Tuple[List[str], dict, Path]], timeout: float = 600) -> Dict[K, Tuple[int, str]]:
    """Start every job (command, environment, working folder) at once, each in its own session, and wait for all:
    key -> (exit code, its stdout and stderr together). Whatever a job leaves behind is killed."""
    procs = {key: start_command(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for key, (cmd, env, cwd) in jobs.items()}
    results = {}
    try:
        for key, proc in procs.items():
            output, _ = proc.communicate(timeout=timeout)
            results[key] = (proc.returncode, output)
    finally:
        for proc in procs.values():
            kill_group(proc)
    return results


def record_cases(names: Sequence[str], run: Callable[[str], dict], out_env: str) -> None:
    """A rank's side of ``run_rank_records``: ``run(name)`` for each name in turn (a failure records its traceback)
    and this rank's accelerator, written as its JSON record."""
    import deepspeed
    results = {}
    for name in names:
        try:
            results[name] = run(name)
        except Exception:
            results[name] = {"failed": traceback.format_exc()}
    results["accelerator"] = deepspeed.get_accelerator().device_name()
    Path(f"{os.environ[out_env]}.rank{deepspeed.comm.get_rank()}").write_text(json.dumps(results))


def run_forked_job(target: str, accelerator: str, world_size: int, extra_env: Optional[dict] = None,
                   timeout: float = 600, after_import: Sequence[str] = (), args: Sequence[str] = ()) -> None:
    """``run_ranks(target)`` on ``accelerator`` with the variables a launched run gets (``accelerator_env``); every
    rank must succeed."""
    port = free_port()
    env = {**accelerator_env(accelerator, world_size), **(extra_env or {}), "MASTER_PORT": port}
    try:
        procs = run_ranks(target, world_size, env=env, timeout=timeout, after_import=after_import, args=args)
    finally:
        remove_cpu_comm_buffers(str(port))
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"{accelerator} rank {rank} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"


def run_rank_records(target: str, accelerator: str, world_size: int, out: Path, out_env: str) -> List[dict]:
    """``run_forked_job(target)`` on ``accelerator`` (``out_env`` names ``out`` to the ranks); every rank must write
    its JSON record to ``<out>.rank<N>``, which are returned in rank order."""
    run_forked_job(target, accelerator, world_size, {out_env: str(out)}, after_import=(out_env, ))
    return [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(world_size)]


def on_both_accelerators(launch: Callable[[str, Path], T], workdir: Path) -> Tuple[T, T]:
    """``(launch("xla", workdir / "xla"), launch("cpu", workdir / "cpu"))``, the two run concurrently."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [pool.submit(launch, accelerator, workdir / accelerator) for accelerator in ("xla", "cpu")]
        return jobs[0].result(), jobs[1].result()


def trained_alike(xla: list, cpu: list, case: str) -> List[Tuple[dict, dict]]:
    """Each rank's ``(xla, cpu)`` records of ``case`` (``records_on_both_accelerators``), once both trained it without
    failing, with the same per-step losses and final weights (fp32)."""
    pairs = []
    for rank, (mine, theirs) in enumerate(zip(xla, cpu, strict=True)):
        assert (mine["accelerator"], theirs["accelerator"]) == ("xla", "cpu"), rank
        mine, theirs = mine[case], theirs[case]
        assert "failed" not in theirs, f"CPU accelerator, rank {rank}:\n{theirs['failed']}"
        assert "failed" not in mine, f"XLA, rank {rank}:\n{mine['failed']}"
        assert within(mine["losses"], theirs["losses"], **LOSS_TOLERANCE["float32"]), (
            rank, mine["losses"], theirs["losses"])
        assert mine["params"].keys() == theirs["params"].keys() != set()
        for name, values in mine["params"].items():
            assert within(values, theirs["params"][name], **PARAM_TOLERANCE["float32"]), (rank, name)
        pairs.append((mine, theirs))
    return pairs


def records_on_both_accelerators(target: str, world_size: int, workdir: Path, out_env: str) -> Tuple[list, list]:
    """``(xla, cpu)``: ``run_rank_records(target)`` on each accelerator, the two jobs run concurrently; each a list of
    per-rank records (a module training its cases in turn, ``record_cases``)."""
    return on_both_accelerators(lambda accelerator, out: run_rank_records(target, accelerator, world_size, out, out_env),
                                workdir)


TRAIN = REPO / "scripts" / "train.py"
TRAIN_MANY = REPO / "tests" / "train_many.py"
WARMUP_STEPS = 3  # scripts/train.py's default --warmup-steps
# The 2-rank runs that tests/launched/test_multiprocess_training.py and test_pipeline.py compare with the CPU
# accelerator, and tests/launched/test_checkpoint.py resumes (``Trainings`` runs each once): 20 steps, saving a
# checkpoint at the end of the warm-up, before the steps whose XLA executions the parity tests count.
TWO_RANK_RUN = {"num_procs": 2, "steps": 20, "save_at": (WARMUP_STEPS, )}


def ds_config(stage: int, bf16: bool = False, micro_batch: int = 4, accumulation: int = 1, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # gather and release every parameter
    if bf16:
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


def train_arguments(workdir: Path, label: str, config: dict, steps: int, train_args=()) -> Tuple[List[str], Path]:
    """``scripts/train.py``'s arguments for one training whose files go to ``workdir/<label>-*.json``, and where rank
    0's JSON goes."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / f"{label}-config.json"
    config_path.write_text(json.dumps(config))
    out = workdir / f"{label}-losses.json"
    return ["--deepspeed_config", str(config_path), "--steps", str(steps), "--losses-out", str(out), *train_args], out


def accelerator_env(accelerator: Optional[str], num_procs: int) -> dict:
    """The variables a launched run on ``accelerator`` gets: DS_ACCELERATOR and, for DeepSpeed's CPU accelerator, the
    "device" count it reads (LOCAL_SIZE) and one torch thread per rank, what DeepSpeed's ``--bind_cores_to_rank``
    sets on a 2-core machine. With a thread per core in every rank, the ranks' OpenMP threads spin against each other
    and the XLA side's processes: a CPU-accelerator step of a 2-rank run takes 10x longer."""
    if accelerator != "cpu":
        return {"DS_ACCELERATOR": accelerator}
    return {"DS_ACCELERATOR": accelerator, "LOCAL_SIZE": num_procs, "OMP_NUM_THREADS": 1}


def launch_command(script: Sequence[str], accelerator: Optional[str], num_procs: int = 1,
                   extra_env: Optional[dict] = None, launcher: str = "deepspeed",
                   launcher_args: Sequence[str] = ()) -> Tuple[List[str], dict]:
    """The command that starts ``script`` (a Python file and its arguments) on ``num_procs`` ranks, and its
    environment.

    ``launcher``: ``deepspeed``, ``torchrun``, ``accelerate`` (``accelerate launch``; ``launcher_args`` name its
    ``--config_file``, which sets the number of processes) or ``python`` (one process), which starts ``python
    script`` itself, without the ``deepspeed`` runner and its launcher: on XLA the way a user without a launcher
    does; DeepSpeed's CPU accelerator, which looks for MPI without them, gets the variables a launcher sets for one
    rank.
    """
    env, port = clean_env(**{**accelerator_env(accelerator, num_procs), **(extra_env or {})}), str(free_port())
    script = [*map(str, launcher_args), *map(str, script)]
    if launcher == "python":
        assert num_procs == 1, "launcher='python' starts one process"
        if accelerator == "cpu":
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        return [sys.executable, *script], env
    if launcher == "torchrun":
        return [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(num_procs), "--master_port", port, *script], env
    if launcher == "accelerate":
        return [str(VENV_BIN / "accelerate"), "launch", "--main_process_port", port, *script], env
    assert launcher == "deepspeed", launcher
    return [str(VENV_BIN / "deepspeed"), "--num_gpus", str(num_procs), "--master_port", port, *script], env


def training_command(workdir: Path, accelerator: Optional[str], config: dict, num_procs: int = 1, steps: int = 20,
                     extra_env: Optional[dict] = None, train_args=(),
                     launcher: str = "deepspeed") -> Tuple[List[str], dict, Path]:
    """The command line of ``run_training``, its environment, and where rank 0's JSON goes."""
    args, out = train_arguments(workdir, accelerator or "default", config, steps, train_args)
    return (*launch_command([TRAIN, *args], accelerator, num_procs, extra_env, launcher), out)


def remove_cpu_comm_buffers(master_port: str) -> None:
    """DeepSpeed's CPU accelerator leaves a 69 MB shared-memory all-reduce buffer per rank in /dev/shm
    (named after the master port) when its processes exit; a test run would pile up gigabytes of RAM."""
    for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{master_port}_*"):
        buffer.unlink(missing_ok=True)


def run_job(cmd: List[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a ``launch_command`` to its end; it must succeed."""
    port = next((cmd[i + 1] for i, arg in enumerate(cmd) if arg in ("--master_port", "--main_process_port")),
                env.get("MASTER_PORT"))
    try:
        proc = run_command(cmd, timeout, cwd=cwd, env=env)
    finally:
        if port:
            remove_cpu_comm_buffers(port)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def read_results(out: Path, num_procs: int) -> dict:
    """Rank 0's JSON of a training, with the other ranks' JSON under ``"other_ranks"``."""
    result = json.loads(out.read_text())
    result["other_ranks"] = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(1, num_procs)]
    return result


def run_training(workdir: Path, accelerator: Optional[str], config: dict, num_procs: int = 1, steps: int = 20,
                 extra_env: Optional[dict] = None, timeout: float = 600, train_args=(),
                 launcher: str = "deepspeed") -> dict:
    """``DS_ACCELERATOR=<accelerator> deepspeed --num_gpus N scripts/train.py`` (or ``launch_command``'s other
    ``launcher``); returns ``read_results``.

    ``accelerator=None`` leaves DS_ACCELERATOR unset. Files go to ``<workdir>/<accelerator>-*.json``.
    """
    cmd, env, out = training_command(workdir, accelerator, config, num_procs, steps, extra_env, train_args, launcher)
    run_job(cmd, env, workdir, timeout)
    return read_results(out, num_procs)


def ranks(result: dict) -> List[dict]:
    """Every rank's JSON of a ``run_training`` result, by rank."""
    return [result, *result["other_ranks"]]


def training(accelerator: Optional[str], config: dict, num_procs: int = 1, steps: int = 20,
             train_args: Sequence[str] = (), extra_env: Optional[dict] = None, save_at: Sequence[int] = (),
             dump_hlo: bool = False, launcher: Optional[str] = None, load_from: Optional[dict] = None) -> dict:
    """One training of ``Trainings``, as data. ``save_at``: steps after which it saves a checkpoint into its
    ``result["save_dir"]``; ``dump_hlo``: XLA writes the HLO of every graph it compiles into ``result["hlo_dir"]``;
    ``load_from``: another training whose checkpoints it resumes from. One process runs as ``python
    scripts/train.py`` unless ``launcher`` asks for ``deepspeed``: the launcher is under test in the multi-process
    runs, and skipping its two interpreters halves a one-process run. DeepSpeed's CPU accelerator, the reference,
    tests no launcher: its ranks fork from a fork server (``"fork"``), which spares a job its runner, launcher and
    the ranks' imports (docs/performance.md)."""
    default = "fork" if accelerator == "cpu" else "python" if num_procs == 1 else "deepspeed"
    return {"accelerator": accelerator, "config": config, "num_procs": num_procs, "steps": steps,
            "train_args": list(train_args), "extra_env": {k: str(v) for k, v in (extra_env or {}).items()},
            "save_at": list(save_at), "dump_hlo": dump_hlo, "launcher": launcher or default, "load_from": load_from}


def _key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, default=str)


# What a job's processes share: trainings differing only in this run in one job.
_JOB = ("accelerator", "num_procs", "extra_env", "dump_hlo", "launcher")
_PLANNED: Dict[str, List[dict]] = {}


def plan(group: str, *trainings: dict) -> None:
    """Declare trainings (``training(...)``) that tests of this session will ask ``Trainings`` for. When a test
    first asks for one, those of its group that need the same processes run in one job (``tests/train_many.py``),
    in the order planned: one launch, one set of interpreters, for all of them. Call at import (collection)."""
    for spec in trainings:
        assert not spec["dump_hlo"] or spec["num_procs"] == 1, "the HLO of a job's runs is told apart on one rank"
        _PLANNED.setdefault(group, []).append(spec)


def plan_against_cpu(group: str, config: dict, **kwargs) -> None:
    """``plan`` the XLA and the CPU-accelerator side of ``Trainings.against_cpu(config, **kwargs)``."""
    plan(group, training("xla", config, **kwargs), training("cpu", config, **kwargs))


class Trainings:
    """The trainings shared by the tests of a session (the ``trainings`` fixture): each distinct training runs
    once, the first time a test asks for it (with the rest of its ``plan`` group), and later tests get the same
    result. Results are shared: tests must not modify them."""

    def __init__(self, root: Path):
        self.root = root
        self._runs: Dict[str, Future] = {}
        self._workdirs: Dict[str, Path] = {}
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()

    def run(self, accelerator: Optional[str], config: dict, **kwargs) -> dict:
        """The result of ``training(accelerator, config, **kwargs)``: ``run_training``'s, with ``save_dir`` and
        ``hlo_dir``."""
        return self.result(training(accelerator, config, **kwargs))

    def result(self, spec: dict) -> dict:
        key = _key(spec)
        with self._lock:
            jobs = [] if key in self._runs else self._jobs_of(spec)
            for member in (member for job in jobs for member in job):
                self._runs[_key(member)] = Future()
                self._workdirs[_key(member)] = self.root / f"run{len(self._workdirs)}"
        for job in jobs[1:]:  # the group's other jobs (the CPU side of an XLA job) run meanwhile
            thread = threading.Thread(target=self._launch, args=(job, ), daemon=True)
            thread.start()
            self._threads.append(thread)
        if jobs:
            self._launch(jobs[0])
        return self._runs[key].result()

    def close(self) -> None:
        """Wait for the jobs started for other tests (a session that asked for only part of a group)."""
        for thread in self._threads:
            thread.join()

    def _jobs_of(self, spec: dict) -> List[List[dict]]:
        """The jobs that start when ``spec`` is first asked for: its own first (``spec`` and the trainings planned
        with it that need the same processes), then the other jobs of its group; only trainings not yet started."""
        key = _key(spec)
        group = next((group for group in _PLANNED.values() if any(_key(p) == key for p in group)), [spec])
        jobs: Dict[str, Dict[str, dict]] = {}
        for planned in group:
            if _key(planned) not in self._runs:
                jobs.setdefault(_key({f: planned[f] for f in _JOB}), {})[_key(planned)] = planned
        own = _key({f: spec[f] for f in _JOB})
        return [list(jobs.pop(own).values()), *(list(job.values()) for job in jobs.values())]

    def _launch(self, job: List[dict]) -> None:
        """Run ``job``'s trainings in one launched job; each one's future gets its result (or the job's error)."""
        try:
            first, runs, results = job[0], [], []
            for spec in job:
                workdir = self._workdirs[_key(spec)]
                args = list(spec["train_args"])
                if spec["save_at"]:
                    args += ["--save-dir", str(workdir / "checkpoints"), "--save-at", *map(str, spec["save_at"])]
                if spec["load_from"]:
                    args += ["--load-dir", str(self.result(spec["load_from"])["save_dir"])]
                args, out = train_arguments(workdir, spec["accelerator"] or "default", spec["config"], spec["steps"],
                                            args)
                hlo_dir = workdir / "hlo" if spec["dump_hlo"] else None
                runs.append({"args": args, "hlo_dir": hlo_dir and str(hlo_dir)})
                results.append((spec, out, {"save_dir": workdir / "checkpoints" if spec["save_at"] else None,
                                            "hlo_dir": hlo_dir}))
            extra_env, jobdir = dict(first["extra_env"]), self._workdirs[_key(first)]
            dumps = jobdir / ("hlo" if len(runs) == 1 else "job-hlo")
            if first["dump_hlo"]:
                flags = extra_env.get("XLA_FLAGS", FAST_COMPILE["XLA_FLAGS"])
                extra_env["XLA_FLAGS"] = f"{flags} --xla_dump_to={dumps} --xla_dump_hlo_as_text"
            plan_file, timeout = jobdir / "runs.json", 600 + 120 * len(runs)
            if first["launcher"] == "fork":
                plan_file.write_text(json.dumps(runs))
                run_forked_job("tests.train_many:main", first["accelerator"], first["num_procs"], extra_env, timeout,
                               args=["--runs", plan_file])
            else:
                if len(runs) == 1:
                    script = [TRAIN, *runs[0]["args"]]
                else:
                    plan_file.write_text(json.dumps(runs))
                    script = [TRAIN_MANY, "--runs", plan_file, *(("--hlo-dumps", dumps) if first["dump_hlo"] else ())]
                cmd, env = launch_command(script, first["accelerator"], first["num_procs"], extra_env,
                                          first["launcher"])
                run_job(cmd, env, jobdir, timeout)
            for spec, out, dirs in results:
                self._runs[_key(spec)].set_result({**read_results(out, spec["num_procs"]), **dirs})
        except BaseException as exc:  # every test waiting on this job fails with the same error
            for spec in job:
                if not self._runs[_key(spec)].done():
                    self._runs[_key(spec)].set_exception(exc)

    def against_cpu(self, config: dict, **kwargs) -> Tuple[dict, dict]:
        """The same training on XLA and on DeepSpeed's CPU accelerator, run concurrently; ``(xla, cpu)``. ``kwargs``
        go to ``training`` for both (``dump_hlo`` to the XLA side only)."""
        dump_hlo = kwargs.pop("dump_hlo", False)
        with ThreadPoolExecutor(max_workers=2) as pool:
            xla = pool.submit(self.run, "xla", config, dump_hlo=dump_hlo, **kwargs)
            cpu = pool.submit(self.run, "cpu", config, **kwargs)
            return xla.result(), cpu.result()


def counts_per_step(result: dict) -> dict:
    """After ``scripts/train.py``'s warm-up: XLA compilations (in all), executions and device->host transfers per step."""
    warm, end = result["counters"]["warm"], result["counters"]["end"]
    steps = len(result["losses"]) - WARMUP_STEPS
    return {key: (end[key] - warm[key]) / (1 if key == "compilations" else steps) for key in end}


# How close a run on XLA must come to the same run on DeepSpeed's CPU accelerator. Losses: fp32 absolute (they are
# ~1-4); bf16 relative to the CPU run's value, since a bf16 number is only as exact as a fraction of itself. Final
# weights, element by element: fp32 runs differ by float32 round-off (measured: at most 1.4e-6); bf16 runs by a
# bf16 step of a weight (1/128 of it: 7.8e-3 for LayerNorm's ~1.0) and, on weights with small gradients, by the
# few Adam steps (lr 3e-3 each) their bf16 gradients' rounding turned the other way (measured: at most 5e-3).
LOSS_TOLERANCE = {"float32": {"atol": 1e-4, "rtol": 0.0}, "bfloat16": {"atol": 0.0, "rtol": 5e-3}}
PARAM_TOLERANCE = {"float32": {"atol": 1e-5, "rtol": 1e-4}, "bfloat16": {"atol": 1.5e-2, "rtol": 1 / 64}}
# The key biases (the middle third of each ``qkv.bias`` in scripts/train.py's model) get no gradient: the softmax
# ignores a constant added to every key, so theirs is round-off, which Adam scales up to full steps of lr in
# arbitrary directions. Two implementations disagree there by up to 2 x lr x steps (train.py: 3e-3, <= 20 steps).
KEY_BIAS_ATOL = 2 * 3e-3 * 20 + 1e-3


def training_dtype(config: dict) -> str:
    """The dtype a DeepSpeed config trains the model's weights in."""
    return "bfloat16" if config.get("bf16", {}).get("enabled") else "float32"


def within(actual, expected, atol: float, rtol: float) -> bool:
    """|actual - expected| <= atol + rtol * |expected|, element by element (numbers or nested lists)."""
    import torch
    actual, expected = torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    return actual.shape == expected.shape and bool(((actual - expected).abs() <= atol + rtol * expected.abs()).all())


def assert_trains_like(xla: dict, cpu: dict, dtype: str, loss_tolerance: Optional[dict] = None) -> None:
    """``xla`` and ``cpu`` (``run_training`` results of one training) agree: rank 0's per-step losses, and every
    rank's final weights, which both hold in ``dtype`` (the module's weights DeepSpeed trains, not fp32 masters)."""
    assert (xla["accelerator"], cpu["accelerator"]) == ("xla", "cpu")
    assert xla["world_size"] == cpu["world_size"] and xla["first_step"] == cpu["first_step"]
    assert len(xla["losses"]) == len(cpu["losses"]) > 0 and all(map(math.isfinite, xla["losses"])), xla["losses"]
    tolerance = loss_tolerance or LOSS_TOLERANCE[dtype]
    assert within(xla["losses"], cpu["losses"], **tolerance), (
        f"losses differ beyond {tolerance}:\nxla {xla['losses']}\ncpu {cpu['losses']}")
    assert_weights_like(xla, cpu, dtype)


def assert_weights_like(xla: dict, cpu: dict, dtype: str, key_bias: Tuple[str, float] = ("qkv.bias", KEY_BIAS_ATOL)
                        ) -> None:
    """Every rank's final weights in ``xla`` and ``cpu`` agree within ``PARAM_TOLERANCE``, both held in ``dtype``;
    ``key_bias``: the name ending of the model's query-key-value bias and the tolerance of its key third."""
    import torch
    suffix, key_bias_atol = key_bias
    for mine, theirs in zip(ranks(xla), ranks(cpu), strict=True):
        rank = mine["rank"]
        assert mine["params"].keys() == theirs["params"].keys() != set(), rank
        assert set(mine["param_dtypes"].values()) == set(theirs["param_dtypes"].values()) == {dtype}, (
            rank, mine["param_dtypes"], theirs["param_dtypes"])
        for name, values in mine["params"].items():
            values, expected = torch.tensor(values, dtype=torch.float64), torch.tensor(theirs["params"][name],
                                                                                        dtype=torch.float64)
            if dtype == "bfloat16":  # the JSON holds floats: they must be bf16 numbers
                assert torch.equal(values.bfloat16().double(), values), f"rank {rank}: {name} is not bf16"
            assert values.shape == expected.shape, (rank, name)
            atol = torch.full_like(expected, PARAM_TOLERANCE[dtype]["atol"])
            if name.endswith(suffix):
                third = len(expected) // 3
                atol[third:2 * third] = key_bias_atol
            differs = (values - expected).abs() > atol + PARAM_TOLERANCE[dtype]["rtol"] * expected.abs()
            assert not differs.any(), (f"rank {rank}: {name} differs at {differs.nonzero().flatten().tolist()[:5]}: "
                                       f"{values[differs].tolist()[:5]} vs {expected[differs].tolist()[:5]}")
