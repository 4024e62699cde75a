"""Checkpoint on SIGTERM: with ``DS_XLA_CHECKPOINT_ON_SIGTERM=<save_dir>``, SIGTERM on any rank (a preempted spot
VM, a TPU maintenance event) makes every rank save one checkpoint, at one step they agree on, before the job stops.

The ranks must save at the same step: ``save_checkpoint`` has collectives, and a rank that saves while another
trains on would wait in a collective the other never joins. The rank that gets SIGTERM publishes a target step in
the rendezvous store, two past the last step it completed; every step has collectives, so no rank is more than one
step ahead of another, and none has passed the target yet. Every rank reads the store at the end of each optimizer
step (a store read, no device read) and saves when it reaches the target. SIGTERM is learned in the Python handler
(the main thread, between bytecodes) or, while a collective holds the main thread, by the watchdog's thread from the
signal's wakeup fd (``signals.Sigterm``); a lock keeps the step this rank completed and the target it publishes
in order between the two. A SIGTERM that no optimizer step follows within the heartbeat timeout (it came while the
first step compiles, in an evaluation, a data stall or a hang) stops the job without a checkpoint (``overdue``):
the scheduler's SIGKILL would come anyway, and the peers must learn why.
"""
import os
import sys
import threading
import time
from typing import Optional

import torch.distributed as dist

from deepspeed_xla.comm.authentication import Signer
from deepspeed_xla.comm.signals import SIGTERM_CAUSE

SAVE_DIR_ENV = "DS_XLA_CHECKPOINT_ON_SIGTERM"
_PREFIX = "deepspeed_xla/preemption/"
_TARGET = "target"  # "<step> <rank that got SIGTERM>", set once per job


def save_dir_setting() -> Optional[str]:
    """Where to save on SIGTERM, if the user asked for it; the folder is made now so that a path that cannot be
    written fails at start, not at the preemption."""
    value = os.environ.get(SAVE_DIR_ENV, "").strip()
    if not value:
        return None
    try:
        os.makedirs(value, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{SAVE_DIR_ENV}={value!r} cannot be made a folder ({exc}): set it to a writable folder "
                         "where every rank can write its checkpoint files, or unset it.") from None
    return value


class CheckpointOnSigterm:
    """One rank's side of the agreement (see the module docstring)."""

    def __init__(self, store, rank: int, save_dir: str, signer: Optional[Signer] = None):
        """``store``: the watchdog's connection (its ops are short, never a blocking wait, and the main thread reads
        it at each step's end); ``signer``: the watchdog's ``authentication.Signer``."""
        self.rank, self.save_dir = rank, save_dir
        self._store = dist.PrefixStore(_PREFIX, store)
        self._signer = signer or Signer(rank)
        self._lock = threading.RLock()  # the Python handler runs in the main thread, maybe inside ``step_ended``
        self._completed: Optional[int] = None  # the optimizer steps this rank has completed, once it has stepped
        self._sigterm = False  # SIGTERM came; the target is published once a step count is known
        self._progress: Optional[float] = None  # since SIGTERM: when it came, or the last step ended after it
        self.saving = False  # this rank reached the target step
        self._malformed = False  # a target that no rank wrote was read (and said) already
        self.target: Optional[int] = None
        self.sigterm_rank: Optional[int] = None

    def sigterm(self) -> None:
        """SIGTERM came to this rank (from any thread): publish a target, unless one is published already. Before
        this rank's first optimizer step its count is not known: the target is published when that step starts."""
        with self._lock:
            self._sigterm = True
            if self._progress is None:
                self._progress = time.monotonic()
            self._publish()

    def _publish(self) -> None:
        if self._sigterm and self._completed is not None and self.target is None:
            self._store.compare_set(_TARGET, "", self._signer.sign(_TARGET, f"{self._completed + 2} {self.rank}"))

    def step_started(self, completed: int) -> None:
        """This rank starts an optimizer step, ``completed`` steps done."""
        with self._lock:
            self._completed = completed
            self._publish()

    def step_ended(self, completed: int) -> bool:
        """This rank completed its optimizer step ``completed``: whether every rank saves here."""
        with self._lock:
            self._completed = completed
            if self._progress is not None:
                self._progress = time.monotonic()
            self._publish()
            if self.target is None and self._store.check([_TARGET]):
                self._read_target()
            if self.target is not None and completed > self.target:
                raise RuntimeError(f"deepspeed_xla: rank {self.rank} read the checkpoint step {self.target} that "
                                   f"SIGTERM on rank {self.sigterm_rank} asked for only after step {completed}: a "
                                   "rank ran more than one optimizer step ahead of another, without a collective "
                                   f"in between ({SAVE_DIR_ENV})")
            self.saving = completed == self.target
            return self.saving

    def _read_target(self) -> None:
        text = self._signer.verify(_TARGET, self._store.get(_TARGET))
        try:
            target, rank = map(int, (text or "").split())
        except ValueError:  # not what a rank writes: someone else reached the store
            if not self._malformed and text is not None:
                self._malformed = True
                sys.stderr.write(f"[deepspeed_xla] rank {self.rank} ignores the checkpoint step {text[:80]!r} in the "
                                 f"rendezvous store: not '<step> <rank>' as a rank writes it ({SAVE_DIR_ENV})\n")
            return
        self.target, self.sigterm_rank = target, rank

    def overdue(self, seconds: float) -> bool:
        """SIGTERM came to this rank, and no optimizer step ended in the ``seconds`` since it or since the last one:
        nothing brings the checkpoint step closer."""
        with self._lock:
            return self._progress is not None and not self.saving and time.monotonic() - self._progress > seconds

    def unsaved(self, seconds: float, variable: str) -> str:
        """Why this rank stops when ``overdue``; ``variable``: the setting of ``seconds``."""
        return (f"rank {self.rank} {SIGTERM_CAUSE}; no optimizer step ended for {variable}={seconds:g} s after it "
                f"(the first compilation, an evaluation, a data stall or a hang), so no checkpoint was saved "
                f"({SAVE_DIR_ENV})")

    def saved(self, tag: str) -> str:
        """Why this rank stops, once the checkpoint is written."""
        return (f"rank {self.sigterm_rank} {SIGTERM_CAUSE}; every rank saved checkpoint {tag} in {self.save_dir} "
                f"before stopping ({SAVE_DIR_ENV})")
