"""Patches of DeepSpeed's multi-node runner (``deepspeed.launcher.runner`` and its ``multinode_runner`` backends).

- The runner re-reads ``.deepspeed_env`` with a parser that fails on blank lines and comments, after
  deepspeed_xla already parsed it; it is pointed at a normalized copy instead, holding the runner's own value of
  each variable (the shell's where the shell set it, as on this host), in memory only.
- Hostfile names reach ssh (DeepSpeed's checks, pdsh) as arguments: a name starting with ``-`` would be an option.
- pdsh: every host is checked over ssh before the launch (DeepSpeed checks the first); a host that cannot be
  reached otherwise leaves the others waiting at the rendezvous until its timeout.
- Exported values: DeepSpeed wraps one with spaces in double quotes for every backend, but only pdsh hands
  them to a shell; mpirun and srun pass the quotes on (``XLA_FLAGS="--a --b"`` makes XLA abort). srun's
  ``--export`` splits at commas: a value with one travels in srun's own environment instead.
- OpenMPI, MVAPICH and Slurm start the script without DeepSpeed's launcher and never pass it the runner's
  ``--master_addr``/``--master_port``; they are exported, so ``launch_env.fill_scheduler_env`` can use them.
- The job's secret for the rendezvous store (``comm/authentication.py``) is made by the runner where it starts every
  host's ranks (not with ``--no_ssh``: one runner per host) and never exported: the runner logs its command and every
  user of a host can read a command line. The ranks inherit it from the runner's environment (one host; Slurm's
  ``--export=ALL``; the hydra launchers of MPICH, Intel MPI and MVAPICH, which pass their environment), OpenMPI gets
  its name only (``-x NAME``: mpirun reads the value), and pdsh hosts get it through ssh's standard input into a file
  only the user can read, which the host's launcher moves into its environment (``bootstrap``).
"""
import functools
import os
import secrets
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Sequence

from deepspeed_xla import env_vars
from deepspeed_xla.bootstrap import JOB_SECRET, JOB_SECRET_FILE

#: How long one host's ssh check may take by default: a host that does not answer within it is reported unreachable.
SSH_CHECK_TIMEOUT = 15
#: The variable that sets another limit, in seconds, for hosts slower to answer ssh.
SSH_CHECK_TIMEOUT_ENV = "DS_XLA_SSH_CHECK_TIMEOUT"

@functools.lru_cache(maxsize=None)
def _normalized_env_file() -> str:
    """The path of one clean ``.deepspeed_env`` holding what every host must get, or "" if the user has none.

    An anonymous in-memory file (``memfd_create``, close-on-exec) that only this process can open, as
    ``/proc/self/fd/<n>``: the file's values (tokens included) never reach a disk, and go with the runner however it
    ends, SIGKILL included."""
    from deepspeed_xla.env_file import values_for_hosts
    values = values_for_hosts()
    if not values:
        return ""
    fd = os.memfd_create("deepspeed_xla_env")
    with open(fd, "w", closefd=False) as handle:
        handle.writelines(f"{key}={value}\n" for key, value in values.items())
    return f"/proc/self/fd/{fd}"


def runner_env_paths(original):
    """Multi-node runs: DeepSpeed's runner re-reads ``.deepspeed_env`` with a parser that fails on blank
    lines and comments; point it at a normalized copy of what deepspeed_xla already parsed."""
    path = _normalized_env_file()
    return [os.path.dirname(path)] if path else original


def runner_env_name(original):
    path = _normalized_env_file()
    return os.path.basename(path) if path else original


def hostfile_without_options(original):
    """``runner._parse_hostfile``: refuse a host name starting with ``-``, which DeepSpeed's ssh checks and pdsh would
    hand ssh as an option (``-oProxyCommand=...`` runs a command), before anything runs ssh."""

    @functools.wraps(original)
    def parse_hostfile(hostfile_lines):
        pool = original(hostfile_lines)
        options = [host for host in pool if host.startswith("-")]
        if options:
            raise ValueError(f"the hostfile names {', '.join(map(repr, options))}: a host name cannot start with '-' "
                             "(ssh would read it as an option). Write each host's name or address at the start of "
                             "its line.")
        return pool

    return parse_hostfile


def ssh_check_timeout() -> float:
    return env_vars.positive_number(os.environ, SSH_CHECK_TIMEOUT_ENV, "a number of seconds such as 60") \
        or SSH_CHECK_TIMEOUT


def _secret_file_command(path: str) -> str:
    """The remote shell command that writes its standard input to ``path`` (under ``~``), readable by the user only."""
    folder = os.path.dirname(path)
    return f"umask 077 && mkdir -p {folder} && cat > {path}"


def unreachable_hosts(hosts: Sequence[str], ssh_args: Sequence[str], secret: str = "", path: str = "") -> Dict[str, str]:
    """The hosts that ``ssh <ssh_args> <host> true`` cannot reach, all checked at once, with ssh's last words. With a
    ``secret``, the same ssh writes it to ``path`` on each host (through its standard input: on no command line), with
    pdsh's ``%n`` in it replaced by the host's place in ``hosts``: hosts may share a home folder."""
    timeout = ssh_check_timeout()

    def check(host: str) -> str:
        command = _secret_file_command(path.replace("%n", str(hosts.index(host)))) if secret else "true"
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(timeout))}", *ssh_args, "--", host,
               command]
        try:
            proc = subprocess.run(cmd, input=secret, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return (f"no answer within {timeout:g} s (a host that is slow to answer: raise the limit with "
                    f"{SSH_CHECK_TIMEOUT_ENV}=<seconds>)")
        return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]

    with ThreadPoolExecutor(max_workers=min(len(hosts), 32) or 1) as pool:
        failures = dict(zip(hosts, pool.map(check, hosts)))
    return {host: why for host, why in failures.items() if why}


def pdsh_checks_every_host(original):
    """``PDSHRunner.get_cmd``: refuse to launch while a host of the hostfile cannot be reached over ssh with the
    options pdsh will use, naming each such host. ``--no_ssh_check`` does not skip it: that skips DeepSpeed's
    check of the first host with plain ``ssh``, which users turn off when only pdsh's options reach the hosts. The
    same ssh hands each host the job's secret (module docstring)."""

    @functools.wraps(original)
    def get_cmd(self, environment, active_resources):
        secret = environment.get(JOB_SECRET, "")
        path = f"~/.cache/deepspeed_xla/job-secret-{secrets.token_hex(8)}-%n" if secret else ""  # %n: pdsh's node rank
        if secret:
            self.add_export(JOB_SECRET_FILE, path)  # a name, not the secret
        cmd, kill_cmd, env = original(self, environment, active_resources)
        failures = unreachable_hosts(list(active_resources), shlex.split(env.get("PDSH_SSH_ARGS_APPEND", "")), secret,
                                     path)
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
    (unless ``.deepspeed_env`` or the environment already did). srun: a value with a comma, which ``--export=ALL,...``
    would cut at the comma, goes in srun's own environment instead, which ``ALL`` hands every task. OpenMPI: the job's
    secret by name (module docstring)."""

    @functools.wraps(original)
    def get_cmd(self, environment, active_resources):
        for key, value in (("MASTER_ADDR", self.args.master_addr), ("MASTER_PORT", self.args.master_port)):
            if key not in self.exports:
                self.add_export(key, str(value))
        if self.name == "slurm":
            for key in [key for key, value in self.exports.items() if "," in value]:
                environment[key] = self.exports.pop(key)
        cmd = original(self, environment, active_resources)
        if self.name == "openmpi" and environment.get(JOB_SECRET):
            cmd[1:1] = ["-x", JOB_SECRET]  # mpirun hands every rank its own value of it
        return cmd

    return get_cmd


def exports_exact_values(original):
    """``MultiNodeRunner.add_export``: the value arrives as written, and the job's secret not at all. pdsh's remote shell gets it shell-quoted
    (which also keeps ``"``, ``$`` and backquotes); the MPI launchers and srun take it as one argument, unquoted."""

    @functools.wraps(original)
    def add_export(self, key, var):
        if key.strip() == JOB_SECRET:
            return  # it reaches the hosts on no command line (module docstring)
        var = var.strip()
        self.exports[key.strip()] = shlex.quote(var) if self.name == "pdsh" else var

    return add_export


def runner_makes_a_secret(original):
    """``runner.parse_args``: where this runner starts every host's ranks (not ``--no_ssh``), make the job's secret
    unless the user set one (set empty: none)."""

    @functools.wraps(original)
    def parse_args(args=None):
        parsed = original(args)
        if JOB_SECRET not in os.environ and not parsed.no_ssh:
            os.environ[JOB_SECRET] = secrets.token_hex(32)
        return parsed

    return parse_args
