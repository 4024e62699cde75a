"""Forks ``tests.multiproc.start_ranks``'s ranks from one interpreter that has imported torch and torch_xla.

    python tests/fork_server.py FD torch torch_xla   # FD: a SOCK_SEQPACKET socket to the test process

A fresh ``python -c`` per rank spent ~5 s of CPU importing torch and torch_xla before running a line of the test;
here they are imported once and each rank is a ``fork``. A request is a JSON message ``{"env", "cwd", "code"}``
carrying the rank's stdout and stderr as two file descriptors; the answer is ``{"pid"}``, and when that rank ends
``{"pid", "code"}`` (its exit code as ``subprocess`` reports it: ``-N`` for signal N).

The rank leaves the server's loop and runs ``code`` at module level, so it ends as ``python -c code`` does: threads
joined, atexit handlers, an uncaught exception's traceback and exit code 1. Its environment is the request's with
what importing torch_xla added to the server's (torch_xla sets defaults in ``os.environ`` at import). Only
variables that neither torch nor torch_xla reads while being imported may differ between the server and its ranks
(``tests.multiproc`` keys a server by all the others). Imports nothing from ``tests``.
"""
import importlib
import json
import os
import random
import select
import socket
import sys

_BEFORE_IMPORTS = dict(os.environ)
for _module in sys.argv[2:]:  # the point of this process
    importlib.import_module(_module)
_SET_BY_IMPORTS = {key: value for key, value in os.environ.items() if _BEFORE_IMPORTS.get(key) != value}
_MAX_MESSAGE = 1 << 20


def _send(channel: socket.socket, message: dict) -> None:
    channel.send(json.dumps(message).encode())


def _reap(channel: socket.socket) -> None:
    """Tell the test process about every rank that ended (a rank is this server's child, not the test's)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(channel, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(channel: socket.socket) -> tuple:
    """Fork a rank per request. Returns, in the rank only, its request and its stdout and stderr descriptors; the
    server itself exits when the test process closes the socket. Polls (no SIGCHLD handler or wakeup fd: a rank
    would inherit them)."""
    while True:
        if select.select([channel], [], [], 0.05)[0]:
            message, fds, _, _ = socket.recv_fds(channel, _MAX_MESSAGE, 2)
            if not message:
                os._exit(0)
            pid = os.fork()
            if pid == 0:
                channel.close()
                return json.loads(message), fds
            for fd in fds:
                os.close(fd)
            _send(channel, {"pid": pid})
        _reap(channel)


def become_rank(request: dict, out: int, err: int) -> str:
    """This forked process as ``python -c`` would have started it: own session, the request's stdout/stderr,
    working directory and environment, fresh random seeds. Returns the code to run."""
    os.setsid()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**request["env"], **_SET_BY_IMPORTS})
    sys.argv = ["-c"]
    sys.path[0] = ""
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    return request["code"]


_request, (_out, _err) = serve(socket.socket(fileno=int(sys.argv[1])))
exec(compile(become_rank(_request, _out, _err), "<string>", "exec"))
