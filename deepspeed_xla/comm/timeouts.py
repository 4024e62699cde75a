"""The two timeouts of a job's ranks, as NCCL's watchdog and torchelastic keep them apart.

- The collective timeout: how long a collective waits for its peers (gloo, host-staged ops). It must outlast the
  longest compilation difference between ranks, which on TPU can be many minutes.
- The heartbeat timeout: how long a rank may send no heartbeat before the others stop the job. A dead or lost host
  is noticed within it; on TPU, where in-graph collectives never time out, it is the only detector, so it must not
  grow with the collective timeout.
"""
import os
from datetime import timedelta

from deepspeed_xla import env_vars

TIMEOUT_ENV = "DS_XLA_COMM_TIMEOUT"
HEARTBEAT_ENV = "DS_XLA_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT = 60.0  # seconds: a host lost for a minute is gone; a live rank beats every few seconds


def comm_timeout(default: timedelta) -> timedelta:
    """The collective timeout: ``DS_XLA_COMM_TIMEOUT`` seconds if set, else the process group's (DeepSpeed:
    ``init_distributed(timeout=...)``, else ``DEEPSPEED_TIMEOUT`` minutes, else 10 min)."""
    seconds = env_vars.positive_number(os.environ, TIMEOUT_ENV, "a number of seconds such as 600")
    return default if seconds is None else timedelta(seconds=seconds)


def heartbeat_timeout() -> float:
    """Seconds without a heartbeat after which a rank is failed: ``DS_XLA_HEARTBEAT_TIMEOUT``, else 60."""
    seconds = env_vars.positive_number(os.environ, HEARTBEAT_ENV, "a number of seconds such as 60")
    return DEFAULT_HEARTBEAT if seconds is None else seconds
