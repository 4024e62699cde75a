"""Commands in their own session: started, run to their end (or a timeout) and killed with everything they started."""
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple, TypeVar

from tests.conftest import clean_env

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


def remove_cpu_comm_buffers(master_port: str) -> None:
    """DeepSpeed's CPU accelerator leaves a 69 MB shared-memory all-reduce buffer per rank in /dev/shm
    (named after the master port) when its processes exit; a test run would pile up gigabytes of RAM."""
    for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{master_port}_*"):
        buffer.unlink(missing_ok=True)


def job_port(cmd: List[str], env: dict) -> Optional[str]:
    """The master port a launcher's command line (or its environment) gives the job."""
    return next((cmd[i + 1] for i, arg in enumerate(cmd) if arg in ("--master_port", "--main_process_port")),
                env.get("MASTER_PORT"))


def run_jobs(jobs: Dict[K, Tuple[List[str], dict, Path]], timeout: float = 600) -> Dict[K, Tuple[int, str]]:
    """Start every job (command, environment, working folder) at once, each in its own session, and wait for all:
    key -> (exit code, its stdout and stderr together). Whatever a job leaves behind is killed, and its CPU
    accelerator's shared-memory buffers removed."""
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
        for cmd, env, _ in jobs.values():
            port = job_port(cmd, env)
            if port:
                remove_cpu_comm_buffers(str(port))
    return results
