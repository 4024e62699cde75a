"""docs/bad_input.md's rows about ranks once they run: ranks launched differently stop at ``deepspeed.initialize``
naming the odd rank, bf16 steps skipped in a row warn once, and a device out of memory on one rank is named on every
rank. (The table's other rows: ``test_bad_input.py``.)"""
import json
import re
from importlib import metadata

import pytest

from deepspeed_xla import xla_runtime
from tests.conftest import FIXTURES
from tests.multiproc import last_error, launch_command, run_jobs, run_ranks


DISAGREEING_RANKS = """
import os, sys, torch, deepspeed
rank = int(os.environ["RANK"])
learning_rates = sys.argv[-2:]  # after the launcher's --local_rank
config = {"train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": float(learning_rates[rank])}},
          "tensorboard": {"enabled": False, "output_path": f"tensorboard/rank{rank}"}}  # per rank: may differ
try:
    deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    line = f"rank {rank} initialized"
except RuntimeError as exc:
    line = f"rank {rank} stopped: {exc}"
sys.stdout.write(line + "\\n")  # one write: the ranks share the launcher's pipe, and print writes the newline apart
sys.stdout.flush()
"""
#: What the two ranks are launched with: their learning rates and the fixture's fake version (``fake_version``).
DISAGREEMENTS = {"config": (("0.01", "0.02"), ""), "version": (("0.01", "0.01"), "1:deepspeed_xla:0.0.1")}


@pytest.fixture(scope="module")
def disagreeing_ranks(tmp_path_factory):
    """Both 2-rank launches at once: rank 1 with another learning rate; rank 1 with another deepspeed_xla."""
    jobs = {}
    for name, (rates, fake) in DISAGREEMENTS.items():
        workdir = tmp_path_factory.mktemp(f"disagree-{name}")
        (workdir / "train.py").write_text(DISAGREEING_RANKS)
        env = {"PYTHONPATH": FIXTURES / "fake_version", "DSX_TEST_FAKE_VERSION": fake} if fake else {}
        cmd, env = launch_command([workdir / "train.py", *rates], "xla", 2, env)
        jobs[name] = (cmd, env, workdir)
    return {name: output for name, (_, output) in run_jobs(jobs).items()}


@pytest.mark.parametrize("differs, expected", [
    ("config", "config 'optimizer.params.lr': 0.02 on rank 1 (the others: 0.01 on rank 0)"),
    ("version", "version of deepspeed_xla: \"0.0.1\" on rank 1 (the others: \"{}\" on rank 0)"),
])
def test_ranks_launched_differently_stop_naming_the_odd_rank(disagreeing_ranks, differs, expected):
    """Every rank stops at ``deepspeed.initialize`` with the same message: the odd rank, what differs and both
    values. The per-rank tensorboard folder is no difference."""
    output = disagreeing_ranks[differs]
    expected = expected.format(metadata.version("deepspeed_xla"))
    stopped = [line.split(": ", 1)[1] for line in output.splitlines() if re.match(r"rank \d stopped: ", line)]
    assert len(stopped) == 2 and stopped[0] == stopped[1], output[-6000:]
    message = stopped[0]
    assert message.startswith("deepspeed_xla: the ranks of this job were launched differently: "), message
    assert expected in message and "|" not in message and "tensorboard" not in message, message
    assert "give every host the same config file and environment" in message, message


# Steps whose batch holds an inf (DeepSpeed's step numbers, from 1), and DeepSpeed's progress log every 4 steps: the
# log of step 4 sees 2 skipped in a row, below the warning's default of 3; that of step 8 sees steps 3-6.
INF_STEPS, STEPS_PER_PRINT, STREAK_STEPS = (3, 4, 5, 6), 4, 10


def bf16_engines_with_and_without_inf() -> None:
    """Run by ``run_ranks`` (one rank): two bf16 engines, one fed an inf at ``INF_STEPS``; prints, per engine, the
    deepspeed_xla warnings, the skipped-step count and each step's graph counters as JSON."""
    import warnings
    import deepspeed
    import torch
    from deepspeed.utils.logging import set_log_level_from_string
    set_log_level_from_string("info")  # the progress log
    results = {}
    for name, inf_steps in (("clean", ()), ("inf", INF_STEPS)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                  "bf16": {"enabled": True}, "steps_per_print": STEPS_PER_PRINT}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        counts = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, STREAK_STEPS + 1):
                x = torch.randn(2, 8)
                if step in inf_steps:
                    x[0, 0] = float("inf")
                x = x.to(engine.device, torch.bfloat16)
                before = xla_runtime.graph_counters()
                engine.backward(engine(x).float().pow(2).mean())
                engine.step()
                after = xla_runtime.graph_counters()
                counts.append({key: after[key] - before[key] for key in ("executions", "transfers_to_host")})
            skipped = engine.skipped_steps
        results[name] = {"warnings": [str(w.message) for w in caught if "deepspeed_xla" in str(w.message)],
                         "skipped": skipped, "counts": counts}
    print(json.dumps(results))


def test_bf16_skipped_steps_in_a_row_warn_once_with_the_steps():
    """bf16 has no loss scale that would recover by itself: steps whose gradient norm is inf or NaN are skipped on the
    device, and several in a row get one warning, with the steps, when DeepSpeed's progress log reads the count. The
    warning adds no host read: each step of both engines is the same executions and transfers (the log's steps read
    the count), and a step without a log reads nothing."""
    proc, = run_ranks("tests.launched.test_bad_input_ranks:bf16_engines_with_and_without_inf", 1,
                      env={"DS_ACCELERATOR": "xla"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    clean, inf = results["clean"], results["inf"]
    assert (clean["skipped"], clean["warnings"]) == (0, [])
    assert inf["skipped"] == len(INF_STEPS) and len(inf["warnings"]) == 1, inf
    warning = inf["warnings"][0]
    assert f"{len(INF_STEPS)} optimizer steps in a row were skipped (steps {INF_STEPS[0]}-{INF_STEPS[-1]}):" in warning
    assert "lower the learning rate" in warning and "DS_XLA_SKIP_STREAK=3" in warning, warning
    # DeepSpeed's log numbers the steps as the warning does: its count at step 8 has them all.
    assert f"step={2 * STEPS_PER_PRINT}, skipped={len(INF_STEPS)}," in proc.stdout + proc.stderr
    assert inf["counts"][2:] == clean["counts"][2:], (inf["counts"], clean["counts"])  # after the compilations
    logged = [step % STEPS_PER_PRINT == 0 for step in range(1, STREAK_STEPS + 1)]
    assert all(counts == {"executions": 1, "transfers_to_host": 0}
               for counts, log in zip(clean["counts"][2:], logged[2:]) if not log), clean["counts"]


def device_oom_on_rank_1() -> None:
    """Run by ``run_ranks``: rank 1's step needs 4 TiB of device memory (PJRT CPU: host memory; its address space is
    capped first, so that no overcommitting kernel hands it out), while rank 0 goes on to the next all-reduce."""
    import resource
    import deepspeed
    import torch
    import torch.distributed as dist
    device = deepspeed.get_accelerator().current_device_name()
    deepspeed.init_distributed()
    x = torch.ones(4, device=device)
    dist.all_reduce(x)
    if dist.get_rank() == 1:
        with open("/proc/self/status") as status:
            mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
        huge = torch.zeros(1 << 40, device=device)
        x = x + huge[:4]
        xla_runtime.sync(wait=False)  # a step's end (DeepSpeed's _take_model_step): the execution runs meanwhile
    dist.all_reduce(x)


def test_device_oom_on_one_rank_is_named_on_every_rank():
    """The rank out of memory raises one line naming the cause and the ways out; the rank waiting for it in the
    all-reduce stops with that line, naming the rank."""
    rank0, rank1 = run_ranks("tests.launched.test_bad_input_ranks:device_oom_on_rank_1", 2, timeout=180,
                             env={"DS_ACCELERATOR": "xla", "DS_XLA_COMM_TIMEOUT": 6})
    assert rank0.returncode not in (0, None) and rank1.returncode not in (0, None), rank0.stderr + rank1.stderr
    error = last_error(rank1)
    error = error[error.find("DeviceOutOfMemory: "):]  # the class, without its module and torch's "[rank1]: "
    assert error.startswith("DeviceOutOfMemory: deepspeed_xla: the XLA device (CPU) ran out of memory (Out of memory "
                            "allocating 4398046511104 bytes.): "), rank1.stderr[-6000:]
    assert "micro batch" in error, error
    stops = [line for line in rank0.stderr.splitlines() if line.startswith("[deepspeed_xla] rank 0 stops: ")]
    assert len(stops) == 1 and stops[0].endswith(f"rank 1 raised {error}"), rank0.stderr[-6000:]


def test_device_oom_keeps_the_status_line_of_xla_text(xla_device):
    """XLA's out-of-memory text on TPU goes on for pages after its status line (the program's largest allocations):
    the error keeps that line, the rest stays in its cause. Other errors pass unchanged."""
    status = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm."
    allocations = "\n\nLargest program allocations in hbm:\n" + "\n".join(f"  {i}. Size: 1.0G" for i in range(40))

    def fails(text):
        raise RuntimeError(text)

    with pytest.raises(xla_runtime.DeviceOutOfMemory) as raised:
        xla_runtime._names_out_of_memory(fails)(status + allocations)
    assert "\n" not in str(raised.value) and f"ran out of memory ({status}): " in str(raised.value)
    assert str(raised.value.__cause__) == status + allocations
    with pytest.raises(RuntimeError, match="^buffer deleted$") as raised:
        xla_runtime._names_out_of_memory(fails)("buffer deleted")
    assert type(raised.value) is RuntimeError
