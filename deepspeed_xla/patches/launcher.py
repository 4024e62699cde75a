"""Patches of DeepSpeed's multi-node runner (``deepspeed.launcher.runner`` and its ``multinode_runner`` backends).

- The runner re-reads ``.deepspeed_env`` with a parser that fails on blank lines and comments, after
  deepspeed_xla already parsed it; it is pointed at a normalized copy instead.
- pdsh: every host is checked over ssh before the launch (DeepSpeed checks the first); a host that cannot be
  reached otherwise leaves the others waiting at the rendezvous until its timeout.
- Exported values: DeepSpeed wraps one with spaces in double quotes for every backend, but only pdsh hands
  them to a shell; mpirun and srun pass the quotes on (``XLA_FLAGS="--a --b"`` makes XLA abort).
- OpenMPI, MVAPICH and Slurm start the script without DeepSpeed's launcher and never pass it the runner's
  ``--master_addr``/``--master_port``; they are exported, so ``launch_env.fill_scheduler_env`` can use them.
"""
import functools
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Sequence

#: How long one host's ssh check may take: a host that does not answer within it is reported unreachable.
SSH_CHECK_TIMEOUT = 15


_ENV_FILE_NAME = ".deepspeed_env"


@functools.lru_cache(maxsize=None)
def _normalized_env_dir() -> str:
    """One clean ``.deepspeed_env`` holding what our parser read from the user's files, or "" if none."""
    import os
    import tempfile
    from deepspeed_xla.env_file import merged_env_values
    merged = merged_env_values()
    if not merged:
        return ""
    folder = tempfile.mkdtemp(prefix="deepspeed_xla_env_")
    with open(os.path.join(folder, _ENV_FILE_NAME), "w") as handle:
        handle.writelines(f"{key}={value}\n" for key, value in merged.items())
    return folder


def runner_env_paths(original):
    """Multi-node runs: DeepSpeed's runner re-reads ``.deepspeed_env`` with a parser that fails on blank
    lines and comments; point it at a normalized copy of what deepspeed_xla already parsed."""
    folder = _normalized_env_dir()
    return [folder] if folder else original


def runner_env_name(original):
    return _ENV_FILE_NAME if _normalized_env_dir() else original


def unreachable_hosts(hosts: Sequence[str], ssh_args: Sequence[str]) -> Dict[str, str]:
    """The hosts that ``ssh <ssh_args> <host> true`` cannot reach, all checked at once, with ssh's last words."""
    def check(host: str) -> str:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CHECK_TIMEOUT}", *ssh_args, host, "true"]
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=SSH_CHECK_TIMEOUT + 5)
        except subprocess.TimeoutExpired:
            return f"no answer within {SSH_CHECK_TIMEOUT} s"
        return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]

    with ThreadPoolExecutor(max_workers=min(len(hosts), 32) or 1) as pool:
        failures = dict(zip(hosts, pool.map(check, hosts)))
    return {host: why for host, why in failures.items() if why}


def pdsh_checks_every_host(original):
    """``PDSHRunner.get_cmd``: refuse to launch while a host of the hostfile cannot be reached over ssh with the
    options pdsh will use, naming each such host. ``--no_ssh_check`` does not skip it: that skips DeepSpeed's
    check of the first host with plain ``ssh``, which users turn off when only pdsh's options reach the hosts."""

    @functools.wraps(original)
    def get_cmd(self, environment, active_resources):
        cmd, kill_cmd, env = original(self, environment, active_resources)
        failures = unreachable_hosts(list(active_resources), shlex.split(env.get("PDSH_SSH_ARGS_APPEND", "")))
        if failures:
            listed = "; ".join(f"{host}: {why}" for host, why in failures.items())
            raise RuntimeError(
                f"cannot reach {', '.join(failures)} over ssh ({listed}). DeepSpeed's pdsh launcher needs "
                f"passwordless ssh from this host to every host of {self.args.hostfile}: fix ssh to "
                f"{', '.join(failures)} (PDSH_SSH_ARGS_APPEND and --ssh_port reach pdsh) or remove "
                f"{'them' if len(failures) > 1 else 'it'} from the hostfile.")
        return cmd, kill_cmd, env

    return get_cmd


def exports_rendezvous(original):
    """``get_cmd`` of the runners that start the script directly: export the runner's master address and port
    (unless ``.deepspeed_env`` or the environment already did)."""

    @functools.wraps(original)
    def get_cmd(self, environment, active_resources):
        for key, value in (("MASTER_ADDR", self.args.master_addr), ("MASTER_PORT", self.args.master_port)):
            if key not in self.exports:
                self.add_export(key, str(value))
        return original(self, environment, active_resources)

    return get_cmd


def exports_exact_values(original):
    """``MultiNodeRunner.add_export``: the value arrives as written. pdsh's remote shell gets it shell-quoted
    (which also keeps ``"``, ``$`` and backquotes); the MPI launchers and srun take it as one argument, unquoted."""

    @functools.wraps(original)
    def add_export(self, key, var):
        var = var.strip()
        self.exports[key.strip()] = shlex.quote(var) if self.name == "pdsh" else var

    return add_export
