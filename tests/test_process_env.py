"""A process's own environment stays its own: what it sets for its device (its topology, its rank of one) is undone in
every process it starts, by fork, spawn, forkserver, ``torch.multiprocessing.spawn`` or ``subprocess``; the children
count the host's devices and set up their own, and DeepSpeed's own test harness trains as on its CPU accelerator."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_xla import process_env
from deepspeed_xla.bootstrap import PROCESS_ENV
from tests.conftest import clean_env
from tests.devices.test_tpu import HOSTS, OUTPUTS, fake_metadata
from tests.multiproc import LOSS_TOLERANCE, PARAM_TOLERANCE, on_both_accelerators, run_command, within

SHOW = "import json, os; print(json.dumps({name: os.environ.get(name) for name in ('DSX_A', 'DSX_B', 'DSX_C')}))"


@pytest.fixture
def own_changes(monkeypatch):
    """A fresh record of this process's own changes, and the variables the test sets, undone after it."""
    monkeypatch.setattr(process_env, "_changes", {})
    for name in ("DSX_A", "DSX_B", "DSX_C", PROCESS_ENV):
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    monkeypatch.setenv("DSX_B", "launcher's")


def _child_view(env=None) -> dict:
    proc = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _fork_view() -> dict:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, json.dumps({name: os.environ.get(name) for name in ("DSX_A", "DSX_B", "DSX_C")}).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        return json.loads(pipe.read())


def test_a_change_for_this_process_is_undone_in_its_children(own_changes):
    launched = {"DSX_A": None, "DSX_B": "launcher's", "DSX_C": None}
    assert _child_view() == _fork_view() == launched  # the reference: nothing recorded yet
    with process_env.for_this_process():
        os.environ["DSX_A"] = "mine"
        os.environ["DSX_B"] = "mine"
    os.environ["DSX_C"] = "for the children"
    ours = {"DSX_A": "mine", "DSX_B": "mine", "DSX_C": "for the children"}
    assert {name: os.environ.get(name) for name in ours} == ours
    assert _child_view() == _fork_view() == dict(launched, DSX_C="for the children")
    assert {name: process_env.launch_environment().get(name) for name in ours} == dict(launched, DSX_C=ours["DSX_C"])
    with process_env.for_this_process():
        del os.environ["DSX_B"]
    assert _child_view()["DSX_B"] == "launcher's"
    os.environ["DSX_A"] = "set again, for the children"
    assert _child_view()["DSX_A"] == "set again, for the children"


def test_a_grandchild_starts_from_the_launch_environment_too(own_changes):
    """The child undid the record: its own child inherits the child's environment, which is the launcher's."""
    with process_env.for_this_process():
        os.environ["DSX_A"] = "mine"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SHOW!r}])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout) == {"DSX_A": None, "DSX_B": "launcher's", "DSX_C": None}, proc.stderr[-2000:]


@pytest.mark.parametrize("record", ["not json", '{"pid": 1}', '{"pid": 1, "vars": {"DSX_A": "no pair"}}'])
def test_a_record_the_startup_hook_cannot_read_is_dropped(own_changes, record):
    """The hook runs in every Python process: a record it cannot read must not stop the interpreter or the hook."""
    code = SHOW.replace("print(", "import sys; print(any(type(f).__name__ == '_DeepSpeedFinder' for f in sys.meta_path), ")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **{PROCESS_ENV: record}))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert proc.stdout.split(" ", 1) == ["True", json.dumps({"DSX_A": None, "DSX_B": "launcher's", "DSX_C": None}) + "\n"]


# A process that asked its accelerator for the device (CALL), then starts workers the ways Python programs do; each
# worker reports what it inherited and the host's device count, then sets up its device as rank r of n (as a launcher
# would place it) and reports the topology it wrote.
CHILDREN = """
import json, os, sys
import multiprocessing as mp
from pathlib import Path

OUT = Path(os.environ["DSX_TEST_OUT"])
WATCHED = json.loads(os.environ["DSX_TEST_WATCHED"])
if os.environ["PJRT_DEVICE"] == "TPU":  # a v4-8 host: its 4 chips on PCI, here and in every spawned child
    from tpu_info import device as chips
    chips.get_local_chips = lambda: (chips.TpuChip.V4, 4)


def worker(local_rank, world, method):
    inherited = {name: os.environ.get(name) for name in WATCHED}
    from deepspeed_xla.devices import current_device_type
    host_devices = current_device_type().local_device_count()
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_SIZE=str(world), RANK=str(local_rank), WORLD_SIZE=str(world))
    from deepspeed_xla import process_setup
    process_setup.prepare_process()
    seen = {"inherited": inherited, "host_devices": host_devices,
            "topology": {name: os.environ.get(name) for name in WATCHED}}
    (OUT / f"{method}-{world}-{local_rank}.json").write_text(json.dumps(seen))


def start(method, world):
    if method == "torch.multiprocessing.spawn":
        import torch.multiprocessing
        torch.multiprocessing.spawn(worker, args=(world, method), nprocs=world)
        return
    procs = [mp.get_context(method).Process(target=worker, args=(rank, world, method)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0, (method, world, proc.exitcode)


if __name__ == "__main__":
    import deepspeed
    accelerator = deepspeed.get_accelerator()
    CALL
    parent = {"device_count": accelerator.device_count(), "own": {name: os.environ.get(name) for name in WATCHED}}
    (OUT / "parent.json").write_text(json.dumps(parent))
    for method, world in json.loads(sys.argv[1]):
        start(method, world)
"""
CPU_TOPOLOGY = ("CPU_NUM_DEVICES", "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT")
ONE_RANK_WORLD = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
ALL = ["fork", "spawn", "torch.multiprocessing.spawn"]


def _run_children(tmp_path, call: str, starts, **env) -> tuple:
    watched = CPU_TOPOLOGY + OUTPUTS + ONE_RANK_WORLD
    script = tmp_path / "children.py"  # a file: spawned children import their target from it
    script.write_text(CHILDREN.replace("CALL", call))
    proc = run_command([sys.executable, str(script), json.dumps(starts)], 600,
                       cwd=tmp_path, env=clean_env(DS_ACCELERATOR="xla", DSX_TEST_OUT=tmp_path,
                                                   DSX_TEST_WATCHED=json.dumps(watched), **env))
    assert proc.returncode == 0, proc.stderr[-4000:]
    workers = {(method, world, rank): json.loads((tmp_path / f"{method}-{world}-{rank}.json").read_text())
               for method, world in starts for rank in range(world)}
    return json.loads((tmp_path / "parent.json").read_text()), workers


@pytest.mark.parametrize("call, starts", [
    ("accelerator.device_name()", [(method, world) for method in ALL for world in (2, 4)]),
    ("accelerator.device()", [("spawn", 2)]),  # the runtime started: no fork child could use XLA
    ("accelerator.communication_backend_name()", [("fork", 2)]),  # the parent is rank 0 of 1, for itself
])
def test_children_of_a_prepared_cpu_process_set_up_their_own_devices(tmp_path, call, starts):
    parent, workers = _run_children(tmp_path, call, starts, CPU_NUM_DEVICES=4)
    prepared = "communication_backend_name" not in call
    assert parent["own"]["CPU_NUM_DEVICES"] == ("1" if prepared else "4")  # the parent did set itself up
    assert parent["device_count"] == 4
    for (method, world, rank), seen in workers.items():
        assert seen["host_devices"] == 4, (method, world, rank, seen)
        assert not any(seen["inherited"][name] for name in ONE_RANK_WORLD), (method, seen["inherited"])
        assert seen["inherited"]["CPU_NUM_DEVICES"] == "4", (method, world, rank, seen)
        assert {name: seen["topology"][name] for name in CPU_TOPOLOGY} == {
            "CPU_NUM_DEVICES": "1", "PJRT_LOCAL_PROCESS_RANK": str(rank), "PJRT_LOCAL_PROCESS_COUNT": str(world)}


def test_children_of_a_prepared_tpu_process_set_up_their_own_chips(tmp_path, monkeypatch):
    """On a faked v4-8 host (4 chips): the parent took chip 0 as a lone process; each of 4 workers takes its own
    chip in a 4-process topology, the one torch_xla's ``configure_topology`` writes into a clean environment."""
    from torch_xla._internal import tpu
    expected = []
    for rank in range(4):
        fake_metadata(monkeypatch, "v4-8")
        tpu.configure_topology(rank, 4)
        expected.append({name: os.environ[name] for name in OUTPUTS})
    fake_metadata(monkeypatch, "v4-8")
    metadata = {name: os.environ[name] for name in os.environ if name.startswith("TPU_")}
    parent, workers = _run_children(tmp_path, "accelerator.device_name()", [(method, 4) for method in ALL],
                                    PJRT_DEVICE="TPU", **metadata)
    assert parent["device_count"] == HOSTS["v4-8"][3] == 4
    assert parent["own"]["TPU_VISIBLE_CHIPS"] == "0" and parent["own"]["TPU_PROCESS_BOUNDS"] == "1,1,1"
    for (method, world, rank), seen in workers.items():
        assert seen["host_devices"] == 4, (method, rank, seen)
        assert not any(seen["inherited"][name] for name in OUTPUTS + ONE_RANK_WORLD), (method, seen["inherited"])
        assert {name: seen["topology"][name] for name in OUTPUTS} == expected[rank], (method, rank)


# DeepSpeed's own harness (tests/unit/common.py, DistributedTest): the pytest process asks for the backend and the
# device name, then a forkserver pool of ranks each sets the rank variables, initializes DeepSpeed, all-reduces and
# trains ZeRO-2 steps, each rank on its own data.
HARNESS = """
import json, os, sys, tempfile
import multiprocessing as mp
import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator


def rank_run(local_rank, world, port, init_method):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(local_rank),
                      RANK=str(local_rank), LOCAL_SIZE=str(world), WORLD_SIZE=str(world))
    accelerator = get_accelerator()
    accelerator.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), init_method=init_method,
                               rank=local_rank, world_size=world)
    dist.barrier()
    device = accelerator.device_name()
    summed = torch.tensor([float(local_rank + 1)], device=device)
    dist.all_reduce(summed)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for step in range(3):
        data = torch.Generator().manual_seed(100 * step + local_rank)
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
        loss = torch.nn.functional.mse_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = [p.detach().float().cpu().flatten().tolist() for p in engine.module.parameters()]
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": summed.item(), "losses": losses,
            "weights": weights, "accelerator": accelerator.device_name()}


if __name__ == "__main__":
    backend = get_accelerator().communication_backend_name()
    get_accelerator().device_name()
    results = {}
    for world, port in zip((2, 4), (int(sys.argv[1]), int(sys.argv[1]) + 1)):
        mp.set_start_method("forkserver", force=True)
        with tempfile.NamedTemporaryFile(delete=False, suffix="_filestore") as store:
            init_method = f"file://{store.name}"
        pool = mp.Pool(processes=world)
        results[world] = pool.starmap(rank_run, [(rank, world, port, init_method) for rank in range(world)])
        pool.close()
        pool.join()
    print(json.dumps(results))
"""


def test_deepspeeds_test_harness_trains_as_on_the_cpu_accelerator(tmp_path):
    from deepspeed_xla.launch_env import free_port

    def launch(accelerator: str, workdir: Path) -> dict:
        workdir.mkdir()
        (workdir / "harness.py").write_text(HARNESS)
        proc = run_command([sys.executable, str(workdir / "harness.py"), str(free_port())], 600, cwd=workdir,
                           env=clean_env(DS_ACCELERATOR=accelerator, CPU_NUM_DEVICES=4))
        assert proc.returncode == 0, (accelerator, proc.stderr[-4000:])
        return json.loads(proc.stdout.strip().splitlines()[-1])

    xla, cpu = on_both_accelerators(launch, tmp_path)
    for world in ("2", "4"):
        assert [r["rank"] for r in xla[world]] == [r["rank"] for r in cpu[world]] == list(range(int(world)))
        assert {r["world"] for r in xla[world]} == {int(world)} and {r["accelerator"] for r in xla[world]} == {"xla"}
        expected_sum = int(world) * (int(world) + 1) / 2
        assert [r["sum"] for r in xla[world]] == [r["sum"] for r in cpu[world]] == [expected_sum] * int(world)
        assert len({tuple(r["losses"]) for r in cpu[world]}) == int(world)  # the ranks really train on their own data
        for ours, reference in zip(xla[world], cpu[world]):
            assert within(ours["losses"], reference["losses"], **LOSS_TOLERANCE["float32"]), (ours, reference)
            for got, want in zip(ours["weights"], reference["weights"]):
                assert within(got, want, **PARAM_TOLERANCE["float32"])
