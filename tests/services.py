"""Services the launcher tests start for themselves, on loopback only, and stop: an ``sshd`` that pdsh logs in
to, and a one-node Slurm cluster (``munged``, ``slurmctld``, ``slurmd``). Each runs in the foreground in its own
session, with its configuration, keys, state and logs under the test's folder."""
import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

from deepspeed_xla.launch_env import free_port
from tests.multiproc import kill_group, start_command

LOOPBACK = "127.0.0.1"


def _wait_for(ready: Callable[[], bool], what: str, procs: List[subprocess.Popen], logs: List[Path],
              timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        exited = [proc.args[0] for proc in procs if proc.poll() is not None]
        if exited or time.monotonic() > deadline:
            tails = "\n".join(f"--- {log}\n{log.read_text()[-2000:]}" for log in logs if log.exists())
            raise RuntimeError(f"{what} did not start ({'exited: ' + ', '.join(exited) if exited else 'timeout'})\n"
                               f"{tails}")
        time.sleep(0.1)


def _sbin(program: str) -> str:
    """A daemon's path: /usr/sbin is not on every PATH."""
    return shutil.which(program) or f"/usr/sbin/{program}"


def _listening(port: int) -> Callable[[], bool]:
    def ready() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex((LOOPBACK, port)) == 0
    return ready


@contextmanager
def _daemons(daemons: List[Tuple[List[str], Path, Callable[[], bool]]], what: str,
             env: Dict[str, str]) -> Iterator[None]:
    """Start each ``(command, log, ready)`` in turn, each once the one before is ready; stop them all at exit."""
    procs: List[subprocess.Popen] = []
    logs = [log for _, log, _ in daemons]
    try:
        for cmd, log, ready in daemons:
            with open(log, "a") as out:
                procs.append(start_command(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                           env=env))
            _wait_for(ready, what, procs, logs)
        yield
    finally:
        for proc in reversed(procs):
            kill_group(proc)


@contextmanager
def sshd(folder: Path) -> Iterator[Dict[str, str]]:
    """An sshd on 127.0.0.1 that lets root in with a throw-away key only. Yields what pdsh needs: ``port`` and
    ``ssh_args`` (for ``PDSH_SSH_ARGS_APPEND``: the key, no host-key prompts). Sessions get ``HOME=<folder>/home``,
    not root's real one."""
    folder.mkdir(parents=True, exist_ok=True)
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key)], check=True)
    shutil.copy(folder / "client_key.pub", folder / "authorized_keys")
    (folder / "home").mkdir()
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    port = free_port()
    config = folder / "sshd_config"
    config.write_text(f"Port {port}\nListenAddress {LOOPBACK}\nHostKey {folder / 'host_key'}\n"
                      f"PidFile {folder / 'sshd.pid'}\nAuthorizedKeysFile {folder / 'authorized_keys'}\n"
                      "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                      f"UsePAM no\nStrictModes no\nSetEnv HOME={folder / 'home'}\n")
    ssh_args = (f"-i {folder / 'client_key'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                "-o LogLevel=ERROR")
    daemon = ([_sbin("sshd"), "-D", "-e", "-f", str(config)], folder / "sshd.log", _listening(port))
    with _daemons([daemon], "sshd", dict(os.environ)):
        yield {"port": str(port), "ssh_args": ssh_args, "home": str(folder / "home")}


@contextmanager
def slurm_cluster(folder: Path, cpus: int = 2) -> Iterator[Dict[str, str]]:
    """A one-node Slurm cluster, node ``localhost`` at 127.0.0.1, authenticated by a munged of its own. Yields the
    environment entries that point Slurm's commands at it (``SLURM_CONF``)."""
    for sub in ("state", "spool", "munge"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    munge = folder / "munge"
    munge.chmod(0o755)
    (munge / "munge.key").write_bytes(os.urandom(1024))
    (munge / "munge.key").chmod(0o400)
    socket_path = munge / "munge.socket"
    ctld_port, slurmd_port, srun_port = free_port(), free_port(), free_port()
    conf = folder / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=dsx", f"SlurmctldHost=localhost({LOOPBACK})", f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}", f"SrunPortRange={srun_port}-{srun_port + 20}",
        "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",  # bind to 127.0.0.1, not to every address
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={socket_path}", f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}", f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin",
        "ReturnToService=2", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SlurmdParameters=config_overrides",
        f"NodeName=localhost NodeAddr={LOOPBACK} NodeHostname=localhost CPUs={cpus} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""]))
    env = {**os.environ, "SLURM_CONF": str(conf)}

    def idle() -> bool:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env)
        return proc.stdout.strip() == "idle"

    daemons = [
        ([_sbin("munged"), "-F", "--force", f"--key-file={munge / 'munge.key'}", f"--socket={socket_path}",
          f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}",
          f"--log-file={folder / 'munged.log'}", f"--origin={LOOPBACK}"], folder / "munged.out", socket_path.exists),
        ([_sbin("slurmctld"), "-D", "-c", "-f", str(conf)], folder / "slurmctld.log", _listening(ctld_port)),
        ([_sbin("slurmd"), "-D", "-N", "localhost", "-f", str(conf)], folder / "slurmd.log", idle),
    ]
    with _daemons(daemons, "the Slurm cluster", env):
        yield {"SLURM_CONF": str(conf)}
