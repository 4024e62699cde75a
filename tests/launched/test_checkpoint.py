"""Checkpoints on XLA: stop and resume exactly, files that load without torch_xla, ``latest`` that
survives a rank dying mid-save.

Each resume test is two 2-rank runs through the ``deepspeed`` CLI: 20 steps saving at step 3 (the run the parity
tests compare with the CPU accelerator), then a new job (one for all configurations) that loads that checkpoint,
trains steps 3-19 and saves at step 20. The second job must repeat the first one's losses and weights exactly (the
same XLA graphs on the same values). A tiny engine's saves and loads across forked ranks: test_checkpoint_ranks.py.
"""
import json
import shutil
import sys
from collections import OrderedDict, namedtuple
from pathlib import Path

import pytest
import torch

from deepspeed_xla import checkpoint, xla_runtime
from tests.conftest import FIXTURES, clean_env
from tests.multiproc import (TWO_RANK_RUN, assert_trains_like, ds_config, plan, ranks, run_command, run_jobs, training,
                             training_command)

PIPELINE = ("--pipeline-stages", "2")
RESUMED_AT = TWO_RANK_RUN["save_at"][0]
# The last pipeline stage's copy of the tied embedding's position table (unused there: only ``tok.weight`` is tied).
# DeepSpeed 0.19.8 saves and loads a stage's layers through ``forward_funcs``, where a tied layer with a
# ``forward_fn`` is a ``functools.partial`` (no state_dict), and after a load re-broadcasts only the tied attributes:
# on every accelerator that stage's untied ``pos`` comes back as the fresh initialisation. With zero gradients AdamW
# only decays it, so the resumed copy is the uninterrupted one with the decay of the steps before the save undone.
# Every other weight of every rank must match exactly.
UNUSED_ON_LAST_STAGE = {"tied_modules.embed.pos"}
CONFIGS = {
    "zero1": (ds_config(1), ()),
    "zero2": (ds_config(2), ()),
    "zero3": (ds_config(3), ()),
    "pipe2": (ds_config(0, micro_batch=2, accumulation=4), PIPELINE),
    "bf16-zero0": (ds_config(0, bf16=True), ()),  # DeepSpeed's FP16_Optimizer, patched on XLA
}

# Run where torch_xla cannot be imported: every tensor in every checkpoint file must load as it was
# stored (no map_location), so each must be a CPU tensor; then DeepSpeed's zero_to_fp32 conversion.
LOAD_WITHOUT_XLA = """
import json, sys
from pathlib import Path
import torch

def tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors(value)

def steps(obj):
    # every step count in a file: the engine's, the client state's, the optimizer's
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("global_steps", "step") and (isinstance(value, int) or torch.is_tensor(value)):
                yield int(value)
            else:
                yield from steps(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from steps(value)

folder, zero_tag = Path(sys.argv[1]), sys.argv[2]
devices, step_counts = {}, {}
for path in sorted(folder.rglob("*.pt")):
    stored = torch.load(path, weights_only=False)
    torch.load(path, map_location="cpu", weights_only=False)
    devices[str(path.relative_to(folder))] = sorted({t.device.type for t in tensors(stored)})
    step_counts[str(path.relative_to(folder))] = sorted(set(steps(stored)))
result = {"devices": devices, "steps": step_counts, "torch_xla_loaded": "torch_xla" in sys.modules}
if zero_tag:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    weights = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=zero_tag)
    result["fp32"] = {name: tensor.tolist() for name, tensor in weights.items()}
print(json.dumps(result))
"""


Pair = namedtuple("Pair", "first second")


def test_to_cpu_copies_every_xla_tensor_with_one_execution():
    import torch_xla
    device = torch_xla.device()
    computed = torch.arange(6.0).to(device) * 2  # pending: materialized by to_cpu
    other = computed + 1  # pending too: one execution for both, not one each
    param = torch.nn.Parameter(torch.ones(3).to(device))
    on_host, shape = torch.ones(2), torch.Size([2, 3])
    state = {"sd": OrderedDict(w=computed, again=computed), "list": [param, 3], "pair": Pair(computed, on_host),
             "shape": shape, "host": on_host, "other": other}
    before = xla_runtime.graph_counters()["executions"]
    saved = checkpoint.to_cpu(state)
    assert xla_runtime.graph_counters()["executions"] - before == 1
    assert isinstance(saved["sd"], OrderedDict) and type(saved["pair"]) is Pair
    assert saved["sd"]["w"] is saved["sd"]["again"] is saved["pair"].first  # one tensor stays one object
    assert saved["shape"] is shape and saved["host"] is on_host and saved["pair"].second is on_host
    assert isinstance(saved["list"][0], torch.nn.Parameter) and saved["list"][0].requires_grad
    assert saved["list"][1] == 3
    assert saved["sd"]["w"].device.type == "cpu" and saved["list"][0].device.type == "cpu"
    assert torch.equal(saved["other"], torch.arange(6.0) * 2 + 1)
    assert torch.equal(saved["sd"]["w"], torch.arange(6.0) * 2)
    assert torch.equal(saved["list"][0].detach(), torch.ones(3))
    assert state["sd"]["w"].device.type == "xla"  # the engine's state is left as it was


def load_without_torch_xla(folder: Path, zero_tag: str = "") -> dict:
    env = clean_env(DS_ACCELERATOR="cpu", PYTHONPATH=FIXTURES / "no_torch_xla")
    proc = run_command([sys.executable, "-c", LOAD_WITHOUT_XLA, str(folder), zero_tag], 300, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def uninterrupted(name: str) -> dict:
    """The 2-rank run saving at step ``RESUMED_AT`` (shared with the parity tests)."""
    config, args = CONFIGS[name]
    return training("xla", config, train_args=args, **TWO_RANK_RUN)


def resumed(name: str) -> dict:
    """A new job that resumes ``uninterrupted(name)`` at step ``RESUMED_AT`` and saves at step 20."""
    config, args = CONFIGS[name]
    return training("xla", config, num_procs=2, steps=20, train_args=args, save_at=(20, ),
                    load_from=uninterrupted(name))


def resumed_across(accelerator: str, saved_by: str) -> dict:
    """``accelerator`` resumes the 2-rank ZeRO-2 checkpoint that ``saved_by`` wrote at step ``RESUMED_AT``."""
    config = CONFIGS["zero2"][0]
    return training(accelerator, config, num_procs=2, steps=20, load_from=training(saved_by, config, **TWO_RANK_RUN))


# One job per accelerator resumes every configuration, after the jobs that saved them.
plan("resume", *map(resumed, CONFIGS), resumed_across("xla", "cpu"), resumed_across("cpu", "xla"))


@pytest.fixture(scope="module")
def runs(trainings):
    """``runs(name)``: the uninterrupted and the resumed run of configuration ``name``."""
    def get(name: str) -> dict:
        full, again = trainings.result(uninterrupted(name)), trainings.result(resumed(name))
        return {"full": full, "resumed": again, "first": full["save_dir"], "at20": again["save_dir"]}

    return get


def assert_reinitialised_and_decayed(resumed: list, full: list, config: dict) -> None:
    """``resumed`` is ``full`` without the weight decay of the ``RESUMED_AT`` steps before the save (see
    ``UNUSED_ON_LAST_STAGE``): the same initialisation, decayed fewer times."""
    params = config["optimizer"]["params"]
    undone = (1 - params["lr"] * params["weight_decay"]) ** RESUMED_AT
    resumed, full = torch.tensor(resumed, dtype=torch.float64), torch.tensor(full, dtype=torch.float64)
    assert not torch.equal(resumed, full)
    torch.testing.assert_close(resumed * undone, full, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_repeats_the_uninterrupted_run(runs, name):
    run = runs(name)
    full, resumed = run["full"], run["resumed"]
    assert (run["first"] / "latest").read_text() == f"global_step{RESUMED_AT}"
    assert resumed["first_step"] == RESUMED_AT
    assert resumed["losses"] == full["losses"][RESUMED_AT:]
    assert resumed["params"] == full["params"]
    for mine, theirs in zip(ranks(resumed)[1:], ranks(full)[1:], strict=True):
        unused = UNUSED_ON_LAST_STAGE if CONFIGS[name][1] == PIPELINE else set()
        assert {k: v for k, v in mine["params"].items() if k not in unused} == {
            k: v for k, v in theirs["params"].items() if k not in unused}, f"rank {mine['rank']}"
        for key in unused:
            assert_reinitialised_and_decayed(mine["params"][key], theirs["params"][key], CONFIGS[name][0])

    zero = CONFIGS[name][0]["zero_optimization"]["stage"] > 0
    loaded = load_without_torch_xla(run["at20"], "global_step20" if zero else "")
    assert not loaded["torch_xla_loaded"]
    assert loaded["devices"] and all(d in ([], ["cpu"]) for d in loaded["devices"].values()), loaded["devices"]
    if zero:
        assert loaded["fp32"] == resumed["params"]


def after(run: dict, step: int) -> dict:
    """``run`` as a resume at ``step`` sees it: the losses from that step on, the same final weights."""
    return {**run, "losses": run["losses"][step:], "first_step": step}


def test_checkpoints_travel_between_accelerators(trainings):
    """A ZeRO-2 checkpoint written by DeepSpeed's CPU accelerator resumes on XLA and trains on as the CPU run did,
    and the reverse."""
    config = CONFIGS["zero2"][0]
    xla_full, cpu_full = trainings.against_cpu(config, **TWO_RANK_RUN)
    xla_from_cpu = trainings.result(resumed_across("xla", "cpu"))
    cpu_from_xla = trainings.result(resumed_across("cpu", "xla"))
    assert xla_from_cpu["first_step"] == cpu_from_xla["first_step"] == RESUMED_AT
    assert_trains_like(xla_from_cpu, after(cpu_full, RESUMED_AT), "float32")
    assert_trains_like(after(xla_full, RESUMED_AT), cpu_from_xla, "float32")


def test_universal_checkpoint_resumes_on_one_rank(runs, trainings, tmp_path):
    """DeepSpeed's ``ds_to_universal`` (run without torch_xla) turns the 2-rank ZeRO-2 checkpoint into one that
    1 rank loads: its first loss is rank 0's loss of the 2-rank run at that step (same weights, same batch), and
    the steps after it, where the loaded Adam moments and step count update the weights, train as the same
    checkpoint does on DeepSpeed's CPU accelerator."""
    run = runs("zero2")
    universal = tmp_path / "universal"
    shutil.copytree(run["first"], universal)
    tag = f"global_step{RESUMED_AT}"
    convert = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state",
               "--input_folder", str(universal / tag), "--output_folder", str(universal / f"{tag}_universal")]
    proc = run_command(convert, 300, env=clean_env(DS_ACCELERATOR="cpu", PYTHONPATH=FIXTURES / "no_torch_xla"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    config = {**CONFIGS["zero2"][0], "checkpoint": {"load_universal": True}}
    xla, cpu = trainings.against_cpu(config, num_procs=1, steps=RESUMED_AT + 6, train_args=("--load-dir", str(universal)))
    assert xla["first_step"] == RESUMED_AT and xla["world_size"] == 1 and len(xla["losses"]) == 6
    assert xla["losses"][0] == run["full"]["losses"][RESUMED_AT]
    assert_trains_like(xla, cpu, "float32")


def test_resume_on_another_world_size_names_both_sizes_and_the_conversion(runs, tmp_path):
    """Without the conversion, the 2-rank ZeRO-2 checkpoint loaded by 1 rank stops at ``load_checkpoint``."""
    folder = runs("zero2")["first"]
    cmd, env, _ = training_command(tmp_path, "xla", CONFIGS["zero2"][0], num_procs=1, steps=RESUMED_AT + 2,
                                   train_args=("--load-dir", str(folder)))
    proc = run_command(cmd, 600, cwd=tmp_path, env=env)
    output = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode != 0, output
    tag = (folder / "latest").read_text()
    assert "saved by 2 data-parallel ranks and is loaded by 1" in output, output
    assert f"ds_to_universal --inject_missing_state --input_folder {folder / tag}" in output, output
    assert '"load_universal": true' in output, output


#: --save-tag of the killed saves -> the tag ``latest`` must name afterwards, with the step-1 checkpoint in it.
KILLED_SAVES = {"": "global_step1", "last": "last"}
SHARD_1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
RANK_0_FILES = "mp_rank_00_model_states.pt,zero_pp_rank_0_mp_rank_00_optim_states.pt"
DISK_FULL = "disk_full"


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    """The jobs at once, each saving at steps 1 and 2, where rank 1 fails in its file of the second save. Killed
    once the files of rank 0 are written whole (upstream's rank 0 writes ``latest`` right after them), under
    DeepSpeed's tags and under one tag saved every time (a "last" checkpoint); and with its disk full."""
    faults = {tag: {"DSX_TEST_DIE_SAVING": f"1:{SHARD_1}", "DSX_TEST_DIE_AFTER_FILES": RANK_0_FILES}
              for tag in KILLED_SAVES}
    faults[DISK_FULL] = {"DSX_TEST_DISK_FULL": f"1:{SHARD_1}"}
    jobs, save_dirs = {}, {}
    for name, fault in faults.items():
        workdir = tmp_path_factory.mktemp(f"killed-{name or 'default'}")
        env = {"PYTHONPATH": FIXTURES / "fault_injection", "DSX_TEST_DIE_AT": 2,
               "DSX_TEST_SAVED_LOG": workdir / "saved.log", **fault}
        tag = ("--save-tag", name) if name in KILLED_SAVES and name else ()
        cmd, env, _ = training_command(workdir, "xla", ds_config(2), num_procs=2, steps=3, extra_env=env,
                                       train_args=("--save-dir", str(workdir / "checkpoints"), "--save-at", "1", "2",
                                                   *tag))
        jobs[name], save_dirs[name] = (cmd, env, workdir), workdir / "checkpoints"
    return {name: (save_dirs[name], *result) for name, result in run_jobs(jobs).items()}


def assert_only_complete_checkpoints(save_dir: Path, kept: str, output: str) -> None:
    """``latest`` names ``kept``, which holds step 1's files (loaded without torch_xla), and nothing else is left."""
    assert (save_dir / "latest").read_text() == kept, output[-6000:]
    assert sorted(p.name for p in save_dir.iterdir() if p.is_file()) == ["latest", "zero_to_fp32.py",
                                                                          "zero_to_torch.py"]
    complete = load_without_torch_xla(save_dir / kept)
    assert sorted(complete["devices"]) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                           SHARD_1]
    assert all(max(counts) == 1 for counts in complete["steps"].values()), complete["steps"]  # all of step 1


@pytest.mark.parametrize("tag", KILLED_SAVES, ids=["global_stepN", "one_tag"])
def test_rank_killed_while_saving_leaves_the_previous_checkpoint(killed_saves, tag):
    save_dir, code, output = killed_saves[tag]
    assert "DYING while saving" in output and code != 0, output[-6000:]
    assert_only_complete_checkpoints(save_dir, KILLED_SAVES[tag], output)


def test_disk_full_on_one_rank_is_named_by_every_rank_and_leaves_the_previous_checkpoint(killed_saves):
    """ENOSPC part-way through rank 1's shard (4 KiB written): each rank raises its error, naming the rank and the file
    (or, should rank 1's reach it first, stops naming it); the half-written tag is removed, no temporary file is
    left."""
    save_dir, code, output = killed_saves[DISK_FULL]
    assert "DISK FULL while saving" in output and code != 0, output[-6000:]
    error = (f"OSError: [Errno 28] deepspeed_xla: rank 1 could not write the checkpoint file {save_dir}/"
             f"global_step2.saving/{SHARD_1}: no space left on device")
    for rank in (0, 1):  # torch prefixes each rank's traceback
        assert f"[rank{rank}]: {error}" in output or f"rank {rank} stops: rank 1 raised {error}" in output, output
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step1", "latest", "zero_to_fp32.py",
                                                          "zero_to_torch.py"]
    assert not [p for p in save_dir.rglob("*") if ".tmp." in p.name or p.name.endswith(".saving")]
    assert_only_complete_checkpoints(save_dir, "global_step1", output)
