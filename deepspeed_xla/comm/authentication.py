"""The values a job's control code writes in the rendezvous store, signed with a per-job secret.

The store is a control channel: a failure written there stops every rank, which prints it; a checkpoint step makes
every rank save and stop; a process registration names the pid a rank's peers watch. torch's TCPStore has no
authentication: whoever reaches MASTER_PORT may write any key. With ``DS_XLA_JOB_SECRET`` set to one secret on every
rank (the multi-node runner forwards ``DS_XLA_*`` to every host), each such value carries an HMAC of its key and
text; a value without a valid one is ignored and said once. Unset, values are taken as they are, as before.
"""
import hashlib
import hmac
import os
import sys
from typing import Optional

SECRET_ENV = "DS_XLA_JOB_SECRET"


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
