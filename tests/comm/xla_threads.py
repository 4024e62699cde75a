"""``xla_ds`` for real: a thread per PJRT CPU device of one process, each thread one rank of the world.

XLA:CPU runs in-graph collectives between the devices of one process (``CPU_NUM_DEVICES=N``), and torch_xla
drives them a thread per device (``pjrt._run_thread_per_device``, what ``xmp.spawn`` does on CPU). The same
scenario then runs on gloo with CPU tensors, a thread per rank, as the reference. Stand-ins of the harness,
each for a constraint of XLA:CPU or of running ranks as threads (docs/troubleshooting.md):

- reads of device data, graph cuts and the watchdog's waits asked by the code under test are counted per thread;
- every graph that may hold a collective is compiled and launched one at a time, under one lock, after the
  thread's device has gone idle: XLA:CPU matches a collective across devices by its HloModule id, and two
  threads compiling the same graph at once get two ids (a rendezvous timeout aborts the process);
- ``isolate``: a graph cut before and after each XLA collective, since graphs that differ by rank around a
  collective (a root's copies, uneven padding) cannot share one module; without it, a scenario runs an op
  whose graph is the same on every rank as one graph and counts its executions;
- a ``fake`` default group of the world's size answers ``dist.get_world_size()`` (torch has one default group
  per process); ``xla_ds`` groups are built one at a time (gloo reads an environment variable while one is built).

It runs in a child process (``run``): a rendezvous timeout aborts the whole process.
    python -m tests.comm.xla_threads tests.comm.test_xla_ds_devices:collectives_scenario 4 OUT.pt
"""
import concurrent.futures
import contextlib
import importlib
import os
import re
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=60)
_COLLECTIVE_HLO = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                             r"(?:-start)?\(.*?replica_groups=(\{[^=]*?\}\})?")


def collectives_in(hlo: str) -> List[tuple]:
    """The (kind, replica groups) of each collective in an HLO text; groups as written by XLA (``{{0,1},{2,3}}``,
    ``{}`` for the whole world)."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE_HLO.search(line)
        if match:
            groups = re.search(r"replica_groups=(\{\}|\{\{[0-9,{}]*\}\})", line)
            found.append((match.group(1), groups.group(1) if groups else "{}"))
    return found


class _Runtime:
    """What the XLA threads of this process share: the compile lock, the store and the counters."""

    def __init__(self, world: int, isolate: bool):
        import torch_xla
        import torch_xla.core.xla_model as xm

        from deepspeed_xla.comm import xla_collectives
        self.world, self.isolate = world, isolate
        self.torch_xla, self.xm = torch_xla, xm
        self.lock, self.build_lock = threading.RLock(), threading.Lock()
        self.store = dist.HashStore()
        self.local = threading.local()
        self.meetings: Dict[tuple, threading.Barrier] = {}
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        self.group_class = xla_collectives.make_process_group_class()
        self._install()

    def wait_own_device(self) -> None:
        self.xm.wait_device_ops(self.torch_xla._XLAC._xla_real_devices([str(self.torch_xla.device())]))

    def cut(self) -> None:
        """Run this thread's pending graph: wait (unlocked) for the device to finish what it launched (a
        collective waits for its peers, which must be free to launch theirs), then compile and launch locked."""
        self.wait_own_device()
        with self.lock:
            self._sync()

    def counter(self, name: str) -> int:
        return getattr(self.local, name, 0)

    def _count(self, name: str) -> None:
        setattr(self.local, name, self.counter(name) + 1)

    def _install(self) -> None:
        """Reads of device data from the code under test are counted per thread and go through ``cut``; with
        ``isolate``, each XLA collective is cut out and the HLO XLA gets for it recorded."""
        runtime, xm = self, self.xm
        self._sync, cpu = self.torch_xla.sync, torch.Tensor.cpu

        def counted_cpu(tensor, *args, **kwargs):
            if tensor.device.type == "xla":
                runtime._count("reads")
                runtime.cut()
            return cpu(tensor, *args, **kwargs)

        def counted_sync(*args, **kwargs):
            runtime._count("syncs")
            runtime.cut()

        from deepspeed_xla.comm import watchdog
        waiting = watchdog.waiting

        @contextlib.contextmanager
        def counted_waiting():
            runtime._count("waits")
            with waiting():
                yield

        torch.Tensor.cpu = counted_cpu
        self.torch_xla.sync = counted_sync
        watchdog.waiting = counted_waiting
        for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute"):
            setattr(xm, name, self._recorded(getattr(xm, name)))

    def _members_meet(self, groups: List[List[int]]) -> None:
        """Wait for the other members of this thread's replica group (all of them: ``groups`` empty). XLA:CPU
        aborts the process when a collective's members arrive more than 10 s apart, which a busy machine's
        compilations alone can cause."""
        ordinal = self.torch_xla.runtime.global_ordinal()
        members = tuple(next((group for group in groups if ordinal in group), range(self.world)))
        with self.build_lock:
            barrier = self.meetings.setdefault(members, threading.Barrier(len(members)))
        barrier.wait()

    def _recorded(self, collective: Callable) -> Callable:
        runtime = self

        def run(*args, **kwargs):
            if runtime.isolate:
                runtime.cut()
            result = collective(*args, **kwargs)
            outputs = [result] if isinstance(result, torch.Tensor) else list(result)
            hlo = runtime.torch_xla._XLAC._get_xla_tensors_hlo([t for t in outputs if t.device.type == "xla"])
            runtime.local.collectives = getattr(runtime.local, "collectives", []) + collectives_in(hlo)[-1:]
            if runtime.isolate:
                runtime._members_meet(kwargs.get("groups") or [])
                runtime.cut()
            return result

        return run


class Rank:
    """One rank of a scenario: its groups, its device, what it reports."""

    def __init__(self, flavour: str, rank: int, world: int, device, runtime: Optional[_Runtime], barrier):
        self.flavour, self.rank, self.world, self.device = flavour, rank, world, device
        self._runtime, self._barrier = runtime, barrier
        self._groups: Dict[tuple, object] = {}
        self.results: Dict[str, torch.Tensor] = {}
        self.facts: Dict[str, object] = {}

    @property
    def is_xla(self) -> bool:
        return self.flavour == "xla"

    def group(self, ranks: Optional[Sequence[int]] = None, tag: str = ""):
        """This rank's group of ``ranks`` (global, any order; None: the world, as the default group), or None
        when it is not a member; ``tag`` tells apart groups of the same ranks. An ``xla_ds`` group gets its
        replica groups as torch_xla's ``new_group`` sets them; the reference is a gloo group of CPU tensors."""
        members = tuple(sorted(ranks)) if ranks is not None else tuple(range(self.world))
        if self.rank not in members:
            return None
        key = (ranks is None, members, tag)
        if key not in self._groups:
            store = dist.PrefixStore(f"{self.flavour}/{tag}/{'world' if ranks is None else members}/",
                                     self._runtime.store if self._runtime else _GLOO_STORE)
            if self.is_xla:
                with self._runtime.build_lock:
                    group = self._runtime.group_class(store, members.index(self.rank), len(members), TIMEOUT)
                if ranks is not None:
                    group._mesh = [list(members)] if len(members) > 1 else [[r] for r in range(self.world)]
            else:
                group = dist.ProcessGroupGloo(store, members.index(self.rank), len(members), TIMEOUT)
            self._groups[key] = group
        return self._groups[key]

    def tensor(self, data: torch.Tensor) -> torch.Tensor:
        """``data`` on this rank's device."""
        return data.to(self.device)

    def report(self, name: str, *tensors: torch.Tensor) -> None:
        """Results compared across flavours: CPU copies, read after ``cut``."""
        self.cut()
        self.results[name] = torch.cat([t.detach().cpu().reshape(-1).float() for t in tensors]) if tensors \
            else torch.zeros(0)

    def cut(self) -> None:
        if self.is_xla:
            self._runtime.cut()

    def graph_collectives(self, tensors: Sequence[torch.Tensor]) -> List[tuple]:
        """The collectives of the graph that would compute ``tensors`` now (XLA flavour)."""
        return collectives_in(self._runtime.torch_xla._XLAC._get_xla_tensors_hlo(list(tensors)))

    def settle(self) -> None:
        """Every rank's launched graphs have run (an execution is counted when it completes). Each waits for its own
        device only, once all have launched: waiting for all devices holds every device's lock, which a peer's
        launch needs (a deadlock)."""
        self.sync_all()
        if self.is_xla:
            self._runtime.wait_own_device()
        self.sync_all()

    def sync_all(self) -> None:
        """Every rank of this flavour reaches this point before any goes on."""
        self._barrier.wait()

    def counters(self) -> Dict[str, int]:
        """This thread's reads and syncs asked by the code under test, and the process's graph counts."""
        if not self.is_xla:
            return {}
        import torch_xla.debug.metrics as met

        def count(name):
            data = met.metric_data(name)
            return int(data[0]) if data else 0

        return {"reads": self._runtime.counter("reads"), "syncs": self._runtime.counter("syncs"),
                "waits": self._runtime.counter("waits"),
                "executions": count("ExecuteTime"),
                "collectives": list(getattr(self._runtime.local, "collectives", []))}


_GLOO_STORE = dist.HashStore()


def _run_gloo(scenario: Callable, world: int) -> Dict[int, Rank]:
    barrier = threading.Barrier(world)

    def one(rank: int) -> Rank:
        state = Rank("gloo", rank, world, torch.device("cpu"), None, barrier)
        scenario(state)
        return state

    with concurrent.futures.ThreadPoolExecutor(max_workers=world) as pool:
        return dict(enumerate(pool.map(one, range(world))))


def _run_xla(scenario: Callable, world: int, isolate: bool) -> Dict[int, Rank]:
    import torch_xla
    from torch_xla._internal import pjrt
    runtime = _Runtime(world, isolate)
    barrier = threading.Barrier(world)

    def one() -> Rank:
        state = Rank("xla", runtime.torch_xla.runtime.global_ordinal(), world, torch_xla.device(), runtime, barrier)
        scenario(state)
        state.cut()
        return state

    return pjrt._run_thread_per_device(0, 1, one, pjrt.initialize_multiprocess)


def main(target: str, world: int, out: str, isolate: bool = True) -> None:
    module, function = target.split(":")
    scenario = getattr(importlib.import_module(module), function)
    gloo = _run_gloo(scenario, world)
    xla = _run_xla(scenario, world, isolate)
    torch.save({flavour: {rank: {"results": state.results, "facts": state.facts} for rank, state in ranks.items()}
                for flavour, ranks in (("gloo", gloo), ("xla", xla))}, out)


def run(target: str, world: int, workdir: Path, isolate: bool = True, timeout: float = 300, **env_vars) -> dict:
    """Run ``target`` ("module:function", called with a ``Rank``) on ``world`` threads of gloo and of XLA devices,
    in a child process with ``env_vars`` set; returns {flavour: {rank: {"results": ..., "facts": ...}}}."""
    from tests.conftest import REPO, clean_env
    from tests.multiproc import run_command
    out = workdir / f"{target.rsplit(':', 1)[1]}-{world}-{int(isolate)}-{len(list(workdir.iterdir()))}.pt"
    env = clean_env(CPU_NUM_DEVICES=world, XLA_THREAD_POOL_SIZE=8, XLA_IO_THREAD_POOL_SIZE=8,
                    PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), DS_ACCELERATOR=None,
                    **env_vars)
    result = run_command([sys.executable, "-m", "tests.comm.xla_threads", target, str(world), str(out),
                          str(int(isolate))], timeout, cwd=REPO, env=env)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return torch.load(out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1" if len(sys.argv) > 4 else True)
