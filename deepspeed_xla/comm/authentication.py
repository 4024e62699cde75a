"""The values a job's control code writes in the rendezvous store, signed with a per-job secret.

The store is a control channel: a failure written there stops every rank, which prints it; a checkpoint step makes
every rank save and stop; a process registration names the pid a rank's peers watch. torch's TCPStore has no
authentication: whoever reaches MASTER_PORT may write any key. With ``DS_XLA_JOB_SECRET`` set to one secret on every
rank (the ``deepspeed`` runner makes one where it starts every host's ranks, never on a command line:
``patches/launcher.py``), each such value carries an HMAC of its key and text; a value without a valid one is
ignored and said once. Unset (``torchrun``, ``srun`` or ``mpirun`` without the runner, ``--no_ssh``) or set empty,
values are taken as they are.
"""
import hashlib
import hmac
import os
import sys
from datetime import timedelta
from typing import Optional

from deepspeed_xla.bootstrap import JOB_SECRET as SECRET_ENV


class Signer:
    """Signs and checks one rank's values (``rank`` names it in what it says)."""

    def __init__(self, rank: int, secret: Optional[str] = None):
        self.rank = rank
        secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
        self._key = secret.encode() or None
        self._said: set = set()  # the keys whose forged values this rank has said it ignores

    def _mac(self, key: str, text: str) -> str:
        return hmac.new(self._key, f"{key}\0{text}".encode(), hashlib.sha256).hexdigest()

    def sign(self, key: str, text: str) -> str:
        """What to store under ``key`` for ``text``."""
        return text if self._key is None else f"{self._mac(key, text)}:{text}"

    def verify(self, key: str, value: bytes) -> Optional[str]:
        """The text of a value read from ``key``; None, said once per key, if no rank of this job signed it."""
        text = value.decode(errors="replace")
        if self._key is None:
            return text
        mac, _, signed = text.partition(":")
        if hmac.compare_digest(mac, self._mac(key, signed)):
            return signed
        if key not in self._said:
            self._said.add(key)
            sys.stderr.write(f"[deepspeed_xla] rank {self.rank} ignores the value under {key!r} in the rendezvous "
                             f"store: it is not signed with this job's {SECRET_ENV} (another program reached the "
                             f"store, or the ranks were given different secrets)\n")
        return None


def same_secret(store, rank: int, signer: Signer, timeout: timedelta) -> None:
    """Every rank has rank 0's secret, or none has one: each ignoring the others' values would leave failures
    unnamed and the checkpoint on SIGTERM unsaved. Compares a value signed with each rank's secret (never the
    secret) with rank 0's, which it waits for up to ``timeout``."""
    mine = signer.sign("secret", "deepspeed_xla").encode()
    store.set(f"secret/{rank}", mine)
    if rank == 0:
        return
    store.wait(["secret/0"], timeout)
    if store.get("secret/0") != mine:
        raise ValueError(f"{SECRET_ENV} differs between rank 0 and rank {rank} (set on one of them only, or to "
                         "different values): set one value on every host, or unset it on every host.")
