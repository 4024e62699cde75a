"""``comm/signals.py``: SIGTERM reaches the rank's handler even during a fork, and a forked child (a DataLoader
worker) gets none of it: SIGTERM's default action, no wakeup fd, none of the pipe's fds. Each case runs in a
process of its own, since handlers and fork hooks cannot be taken back."""
import os
import signal

from deepspeed_xla.comm import signals
from tests.multiproc import run_python

_CATCH = """
import os, signal, sys
from deepspeed_xla.comm import signals
sigterm = signals.Sigterm.catch(os.getpid(), lambda: (print("TOLD THE PEERS", flush=True), os._exit(143)))
"""


def test_sigterm_during_a_fork_reaches_the_handler():
    """A SIGTERM that comes while ``os.fork`` runs (here: from the last fork hook before the fork) used to find
    SIGTERM's default action, which ended the rank without telling its peers."""
    code = ("import os, signal\n"
            "os.register_at_fork(before=lambda: os.kill(os.getpid(), signal.SIGTERM))  # runs after the handler's\n"
            + _CATCH +
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(0)\n"
            "os.waitpid(pid, 0)\n"
            "print('NOT TOLD', flush=True)\n")
    proc = run_python(code, timeout=60)
    assert proc.returncode == 143 and proc.stdout == "TOLD THE PEERS\n", (proc.returncode, proc.stdout,
                                                                          proc.stderr[-3000:])


def test_a_forked_child_has_sigterm_default_and_none_of_the_pipe():
    code = _CATCH + (
        "report_read, report = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    open_fds = []\n"
        "    for fd in (sigterm.read, sigterm.write):\n"
        "        try:\n"
        "            os.fstat(fd)\n"
        "            open_fds.append(fd)\n"
        "        except OSError:\n"
        "            pass\n"
        "    state = [signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.set_wakeup_fd(-1), open_fds,\n"
        "             signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])]\n"
        "    os.write(report, repr(state).encode())\n"
        "    os._exit(0)\n"
        "os.close(report)\n"
        "os.waitpid(pid, 0)\n"
        "print('CHILD', os.read(report_read, 1000).decode())\n"
        "print('PARENT', [sigterm.installed(), signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])])\n")
    proc = run_python(code, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the child: SIGTERM's default, no wakeup fd, no pipe fds, SIGTERM not blocked; the parent: as before the fork
    assert proc.stdout == "CHILD [True, -1, [], False]\nPARENT [True, False]\n", proc.stdout


def test_a_closed_pipe_is_said_once_and_ends_nothing(capsys):
    """EBADF from the wakeup pipe (something closed its fd) used to end the heartbeat thread silently."""
    sigterm = signals.Sigterm(os.getpid(), lambda: None)  # not installed: the pytest process keeps its SIGTERM
    os.close(sigterm.read)
    try:
        assert not sigterm.arrived() and not sigterm.arrived()
    finally:
        os.close(sigterm.write)
    err = capsys.readouterr().err
    assert err.count("[deepspeed_xla] the SIGTERM wakeup pipe of pid") == 1 and "Bad file descriptor" in err, err
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
