"""``python -m deepspeed_xla.bench``: its pure pieces, and one tiny end-to-end run of the floor system.

The floor's counts are facts of a hand-written torch_xla loop (one graph per step, nothing read back), so they
are asserted; times and ratios are not (they live in docs/performance.md).
"""
import argparse
import json
import math
import sys

import pytest
import torch

from deepspeed_xla.bench import cli, clock, example, results, systems
from tests.conftest import REPO, clean_env
from tests.multiproc import run_command

TINY = ["--dim", "32", "--layers", "2", "--seq", "16", "--batch", "4", "--vocab", "64"]


@pytest.mark.parametrize("dim, layers, vocab", [(32, 2, 64), (48, 3, 100)])
def test_matmul_params_are_the_models_minus_its_embeddings(train_module, dim, layers, vocab):
    model = train_module.TinyGPT(vocab, dim, layers, seq=16)
    counted = sum(p.numel() for name, p in model.named_parameters() if name not in ("tok.weight", "pos"))
    assert systems.matmul_params(dim, layers, vocab) == counted


def test_flops_per_token_by_hand():
    # d=32, L=2, V=64, T=16. A block: qkv 32*96+96, proj 32*32+32, MLP 32*128+128 + 128*32+32, 2 LayerNorms 4*32
    # = 12704; the final LayerNorm 64 and the head 32*64+64 = 2176; N = 2*12704 + 2176 = 27584.
    # 6 N = 165504, attention 12*L*T*d = 12*2*16*32 = 12288.
    assert systems.flops_per_token(dim=32, layers=2, vocab=64, seq=16) == 165504 + 12288


def test_system_names():
    assert systems.parse_system("xla-zero3-2p") == systems.System("xla-zero3-2p", "xla", 3, 2)
    assert systems.parse_system("floor") == systems.System("floor", "floor")
    trainer = systems.parse_system("xla-hf-zero2-2p")
    assert trainer == systems.System("xla-hf-zero2-2p", "xla", 2, 2, trainer=True)
    assert trainer.loop == "xla-zero2-2p"
    with pytest.raises(Exception, match=r"floor or <xla\|cpu>-\[hf-\]zero<0-3>-<N>p\[-<feature>\]"):
        systems.parse_system("xla-zero4-1p")


@pytest.mark.parametrize("name, stage, procs, feature, data_parallel", [
    ("xla-zero1-2p-moe", 1, 2, "moe", 2), ("cpu-zero1-2p-sp", 1, 2, "sp", 1), ("xla-zero1-4p-tp", 1, 4, "tp", 2),
    ("xla-zero3-2p-hpz", 3, 2, "hpz", 2), ("xla-zero0-1p-ckpt", 0, 1, "ckpt", 1),
    ("cpu-zero2-1p-offload", 2, 1, "offload", 1), ("xla-zero0-1p-compile", 0, 1, "compile", 1),
    ("xla-zero3-2p-zinit", 3, 2, "zinit", 2), ("xla-zero2-1p-monitors", 2, 1, "monitors", 1),
    ("cpu-zero0-2p-profiler", 0, 2, "profiler", 2), ("xla-zero2-2p-comms", 2, 2, "comms", 2)])
def test_feature_system_names(name, stage, procs, feature, data_parallel):
    system = systems.parse_system(name)
    assert system == systems.System(name, name[:3], stage, procs, feature=feature)
    assert system.data_parallel == data_parallel  # the batches a step trains on: tp and sp ranks share one


@pytest.mark.parametrize("name, refusal", [
    ("xla-zero1-2p-lora", "unknown system .* Features: moe: "), ("xla-hf-zero1-2p-moe", "moe needs scripts/train.py"),
    ("xla-zero2-1p-zinit", "zinit needs ZeRO stage 3"),
    ("xla-zero2-2p-hpz", "hpz needs ZeRO stage 3"), ("xla-zero0-1p-offload", "offload needs ZeRO stage 1/2/3"),
    ("xla-zero1-1p-sp", "sp needs a multiple of 2 processes"), ("xla-zero1-3p-tp", "tp needs a multiple of 2")])
def test_feature_system_refusals_name_the_fix(name, refusal):
    with pytest.raises(argparse.ArgumentTypeError, match=refusal):
        systems.parse_system(name)


def test_feature_configs_and_flags():
    """Each feature's config sections join the system's (``--zero`` options last) and its train.py flags follow."""
    plain = systems.ds_config(1, 4)
    assert systems.ds_config(1, 4, feature="moe") == plain and systems.ds_config(1, 4, feature="ckpt") == plain
    tp = systems.ds_config(1, 4, feature="tp")
    assert tp == dict(plain, tensor_parallel={"autotp_size": 2, "partition_config": systems.TINYGPT_TP_LAYERS})
    assert systems.ds_config(3, 4, feature="hpz")["zero_optimization"] == {
        "stage": 3, "stage3_param_persistence_threshold": 0, "zero_hpz_partition_size": 2}
    offload = systems.ds_config(2, 4, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}, "offload")
    assert offload["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    flags = {name: systems.train_flags(systems.parse_system(f"xla-zero1-2p-{name}")) for name in ("moe", "sp", "tp")}
    assert flags == {"moe": ["--moe-experts", "2"], "sp": ["--sequence-parallel", "2"], "tp": []}
    assert systems.train_flags(systems.parse_system("xla-zero3-1p-zinit")) == ["--zero-init"]
    assert systems.train_flags(systems.parse_system("xla-zero1-2p")) == []


def test_deepspeed_clips_as_the_floor_does():
    """The floor clips only when ``--clip`` is given; DeepSpeed clips to 1.0 when its config says nothing, so the
    config always says: the bench's default run compared DeepSpeed clipping against a floor that did not."""
    from deepspeed.runtime.config import get_gradient_clipping
    assert get_gradient_clipping({}) == 1.0  # why the bench's config must say it
    assert get_gradient_clipping(systems.ds_config(2, 4)) == 0
    assert get_gradient_clipping(systems.ds_config(2, 4, clip=0.5)) == 0.5


def test_feature_outputs_go_to_the_systems_folder(tmp_path):
    """The monitors and the profiler write into the folder the bench gives the system, and the feature's own table
    is left as it was (the next system gets a fresh copy)."""
    monitors = systems.ds_config(1, 4, feature="monitors", outputs=tmp_path)
    assert monitors["csv_monitor"] == {"enabled": True, "job_name": "bench",
                                       "output_path": str(tmp_path / "csv_monitor")}
    assert monitors["tensorboard"]["output_path"] == str(tmp_path / "tensorboard")
    profiler = systems.ds_config(1, 4, feature="profiler", outputs=tmp_path)["flops_profiler"]
    assert profiler == {"enabled": True, "profile_step": 1, "detailed": False,
                        "output_file": str(tmp_path / "flops_profiler")}
    assert "output_path" not in systems.FEATURES["monitors"].config["csv_monitor"]
    assert systems.ds_config(3, 4, feature="zinit") == systems.ds_config(3, 4)


def test_tensor_parallel_layers_are_tinygpts_projections(train_module):
    """The config's AutoTP layer specs name TinyGPT's attention and MLP projections, each in the direction that
    needs one all-reduce per pair, and no other parameter (its embeddings, LayerNorms and head stay whole)."""
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    specs = AutoTPConfig.from_dict(systems.TINYGPT_TP_LAYERS)
    matched = {}
    for name, _ in train_module.TinyGPT(64, 16, 1, seq=16).named_parameters():
        spec = specs.find_matching_spec(name, None)
        if spec:
            matched[name] = (spec.partition_type.value, spec.shape)
    assert matched == {"blocks.0.qkv.weight": ("column", (3, -1)), "blocks.0.mlp.0.weight": ("column", None),
                       "blocks.0.proj.weight": ("row", None), "blocks.0.mlp.2.weight": ("row", None)}


# Parses the Trainer system's arguments as hf_train.py does, in a process of its own: TrainingArguments with a
# DeepSpeed config set up torch.distributed.
PARSE_TRAINER_ARGUMENTS = """
import json, sys
from transformers import HfArgumentParser, TrainingArguments
from deepspeed_xla.bench.example import load_example
hf_train = load_example(sys.argv[1])
trainer, model = HfArgumentParser((TrainingArguments, hf_train.ExampleArguments)).parse_args_into_dataclasses(
    sys.argv[2:])
print(json.dumps({"model": [model.model, model.timings, model.bench_warmup, model.dim],
                  "trainer": [trainer.max_steps, trainer.logging_steps, trainer.per_device_train_batch_size],
                  "optimizer": [trainer.learning_rate, trainer.weight_decay], "clipping": trainer.max_grad_norm,
                  "schedule": str(trainer.lr_scheduler_type)}))
"""


def test_trainer_system_runs_hf_train_on_train_py_settings(tmp_path):
    """The Trainer system's arguments parse as hf_train.py's, and give the Trainer train.py's model and settings:
    the DeepSpeed config's own values (HF stops on a mismatch), no schedule, nothing logged before the end."""
    from deepspeed_xla.bench import driver
    args = cli.parse_args(["--steps", "12", "--warmup", "4", "--batch", "3", "--dim", "16"])
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(systems.ds_config(2, 3)))
    command = driver.trainer_arguments(args, REPO / "scripts" / "train.py", config_path, tmp_path / "o.json", tmp_path)
    assert command[0] == str(REPO / "scripts" / "hf_train.py")
    proc = run_command([sys.executable, "-c", PARSE_TRAINER_ARGUMENTS, *command], 300, cwd=tmp_path,
                       env=clean_env(DS_ACCELERATOR="xla"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed["model"] == ["tinygpt", True, 4, 16]
    assert parsed["trainer"] == [12, 12, 3]
    config = systems.ds_config(2, 3)["optimizer"]["params"]
    assert parsed["optimizer"] == [config["lr"], config["weight_decay"]]
    assert parsed["schedule"] == "SchedulerType.CONSTANT" and parsed["clipping"] == 0


def _rank(times, warm, end, device_bytes, rss):
    keys = ("compilations", "executions", "transfers_to_host")
    return {"step_times": times, "counters": {"warm": dict(zip(keys, warm)), "end": dict(zip(keys, end))},
            "device_bytes": device_bytes, "state_bytes": device_bytes // 2, "peak_rss_bytes": rss,
            "losses": [4.0, 3.0]}


def test_summary_takes_the_slowest_rank_of_each_step_and_the_worst_counts():
    args = cli.parse_args(["--steps", "5", "--warmup", "2", "--seq", "10", "--batch", "3"])
    ranks = [_rank([9, 9, 1.0, 4.0, 2.0], (5, 5, 0), (5, 8, 0), 100, 7),
             _rank([9, 9, 3.0, 1.0, 1.0], (5, 5, 0), (6, 11, 3), 120, 5)]
    row = results.summarize(systems.System("xla-zero1-2p", "xla", 1, 2), ranks, args, peak_flops=None)
    assert row["median_step_s"] == 3.0  # slowest ranks: 3, 4, 2
    assert row["tokens_per_s"] == 2 * 3 * 10 / 3.0
    assert (row["compilations_after_warmup"], row["executions_per_step"], row["transfers_per_step"]) == (1, 2, 1)
    assert (row["device_bytes_per_rank"], row["state_bytes_per_rank"], row["peak_rss_bytes"]) == (120, 60, 7)
    assert row["mfu"] is None
    shared = results.summarize(systems.parse_system("xla-zero1-2p-sp"), ranks, args, peak_flops=None)
    assert shared["tokens_per_s"] == 3 * 10 / 3.0 and shared["feature"] == "sp"  # both ranks train on one batch
    assert row["trace_s"] is None and row["start_to_first_step_s"] is None  # the ranks' JSON has no such figures
    eager_rank = dict(ranks[0], counters={"warm": {}, "end": {}})  # what train.py writes off XLA
    eager = results.summarize(systems.System("cpu-zero0-1p", "cpu"), [eager_rank], args, 1e12)
    assert eager["executions_per_step"] is None and eager["mfu"] is None


def test_step_clock_ends_tracing_when_the_steps_last_graph_started(monkeypatch):
    """On XLA a step's tracing time ends when its last execution started (the device clock's), not when the host
    called ``traced()``; without a device clock it ends there. The first step's end and the process start are
    recorded once, on time.time()'s clock."""
    now = {"time": 100.0}
    monkeypatch.setattr(clock.time, "time", lambda: now["time"])
    executions = [(0.0, None)]
    steps = clock.StepClock(lambda: executions[-1])
    for start, graph_start, seconds in ((100.0, 100.25, 0.5), (101.0, 101.125, 0.25)):
        now["time"] = start
        steps.start()
        steps.traced()
        executions.append((executions[-1][0] + seconds, graph_start))
        now["time"] = start + 0.75
        steps.end()
    results = steps.results()
    assert results["trace_times"] == [0.25, 0.125] and results["execute_times"] == [0.5, 0.25]
    assert results["first_step_end"] == 100.75 and results["process_start"] < 100.75
    eager = clock.StepClock()
    eager.start()
    eager.traced()
    eager.end()
    assert eager.results()["execute_times"] == [None] and 0 <= eager.results()["trace_times"][0]


def test_host_times_take_the_slowest_rank_and_the_first_step():
    ranks = [{"step_times": [5.0, 0.3, 0.4, 0.5], "trace_times": [4.0, 0.1, 0.2, 0.3], "execute_times": [1, 2, 2, 2],
              "step_cpu_times": [9.0, 0.2, 0.2, 0.2], "first_step_end": 50.0, "process_start": 20.0,
              "first_step_cpu": 12.0, "cpu_s": 14.0},
             {"step_times": [6.0, 0.3, 0.3, 0.3], "trace_times": [5.0, 0.2, 0.1, 0.1], "execute_times": [1, 1, 3, 1],
              "step_cpu_times": [8.0, 0.3, 0.1, 0.1], "first_step_end": 51.0, "process_start": 22.0,
              "first_step_cpu": 11.0, "cpu_s": 13.0}]
    times = results.host_times(ranks, warmup=1, launched=10.0)
    assert times == {"trace_s": 0.2, "execute_s": 2, "step_cpu_s": 0.2, "first_step_s": 6.0,
                     "start_to_first_step_s": 30.0, "launch_to_first_step_s": 41.0, "first_step_cpu_s": 12.0,
                     "cpu_s": 27.0}


def test_table_marks_missing_figures_and_failures():
    rows = [{"system": "floor", "median_step_s": 0.01, "tokens_per_s": 1000.0, "compilations_after_warmup": 0,
             "executions_per_step": 1.0, "transfers_per_step": 0.0, "peak_rss_bytes": 2 ** 30,
             "state_bytes_per_rank": 2 ** 19, "device_bytes_per_rank": 2 ** 20, "ratio_to_floor": 1.0, "mfu": None},
            {"system": "cpu-zero0-1p", "median_step_s": 0.02, "tokens_per_s": 500.0, "peak_rss_bytes": 2 ** 29,
             "state_bytes_per_rank": 2 ** 19, "ratio_to_floor": 2.0, "load_average": 3.5},
            {"system": "xla-zero3-2p", "error": "exit code 1"}]
    lines = results.format_table(rows).splitlines()
    assert len({len(line.rstrip()) for line in lines[:2]}) == 1 and "MFU" not in lines[0]
    assert lines[2].split() == ["floor", "10.0", "1,000", "0", "1.00", "0.00", "1024", "0.50", "1.00", "1.00", "-"]
    assert lines[3].split() == ["cpu-zero0-1p", "20.0", "500", "-", "-", "-", "512", "0.50", "-", "2.00", "3.5"]
    assert lines[4].split() == ["xla-zero3-2p", "failed"] + ["-"] * 9
    assert "MFU" in results.format_table([dict(rows[0], mfu=0.42)]).splitlines()[0]
    assert "x train.py" in results.format_table([dict(rows[0], ratio_to_loop=1.05)]).splitlines()[0]


def test_targets():
    row = {"system": "xla-zero3-1p", "accelerator": "xla", "zero_stage": 3, "processes": 1, "ratio_to_floor": 1.2,
           "trace_ratio_to_floor": 1.4, "compilations_after_warmup": 0, "executions_per_step": 3.0,
           "transfers_per_step": 0.0}
    trainer = dict(row, system="xla-hf-zero2-1p", zero_stage=2, executions_per_step=1.0, median_step_s=1.2)
    loop = dict(row, system="xla-zero2-1p", zero_stage=2, median_step_s=1.0)
    results.add_loop_ratios([trainer, loop], [systems.parse_system("xla-hf-zero2-1p"),
                                             systems.parse_system("xla-zero2-1p")])
    assert trainer["ratio_to_loop"] == pytest.approx(1.2) and "ratio_to_loop" not in loop
    feature = dict(row, system="xla-zero3-1p-offload", feature="offload", transfers_per_step=30.0)
    report = {"systems": [row, loop, trainer, feature],
              "bandwidth": {"bytes": 64 << 20, "backend": "xla_host", "ratio": 0.7},
              "zero3_partition": {"ratio": 0.5}}
    verdicts = {t["what"]: t["met"] for t in results.check_targets(report)}
    assert verdicts == {
        "xla-zero3-1p step time / floor": True, "xla-zero3-1p compilations after warm-up": True,
        "xla-zero3-1p tracing time / floor": True, "xla-zero2-1p tracing time / floor": False,  # 1.4: ZeRO-3's 1.5
        "xla-hf-zero2-1p tracing time / floor": False,
        "xla-zero3-1p device->host transfers per step": True,  # ZeRO-3 has no one-execution target
        "xla-zero2-1p step time / floor": False, "xla-zero2-1p compilations after warm-up": True,
        "xla-zero2-1p executions per step": False, "xla-zero2-1p device->host transfers per step": True,
        "xla-hf-zero2-1p step time / floor": False, "xla-hf-zero2-1p step time / xla-zero2-1p": False,
        "xla-hf-zero2-1p compilations after warm-up": True, "xla-hf-zero2-1p executions per step": True,
        "xla-hf-zero2-1p device->host transfers per step": True,
        "xla-zero3-1p-offload compilations after warm-up": True,  # a feature's graphs and transfers are its own
        "all-reduce 64 MB, xla_host / gloo bandwidth": False,
        "ZeRO-3 parameter + optimizer bytes per rank, 2 processes / 1": True}


def test_zero_options_reach_every_deepspeed_config():
    args = cli.parse_args(["--zero", "contiguous_gradients=true", "reduce_bucket_size=5e7"])
    config = systems.ds_config(3, 8, args.zero)["zero_optimization"]
    assert config == {"stage": 3, "stage3_param_persistence_threshold": 0, "contiguous_gradients": True,
                      "reduce_bucket_size": 5e7}
    with pytest.raises(SystemExit):
        cli.parse_args(["--zero", "contiguous_gradients"])


def test_repeats_keep_each_systems_median_run():
    runs = [{"system": "s", "median_step_s": t, "run": i} for i, t in enumerate([0.3, 0.1, 0.2, 0.4])]
    assert results.median_run(runs) == dict(runs[2], repeat_step_s=[0.3, 0.1, 0.2, 0.4])
    assert results.median_run(runs[:3])["run"] == 2
    failed = {"system": "s", "error": "exit code 1"}
    assert results.median_run([*runs, failed]) == failed


def test_bad_arguments_name_the_fix():
    with pytest.raises(SystemExit):
        cli.parse_args(["--steps", "3", "--warmup", "3"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--repeats", "0"])
    with pytest.raises(SystemExit, match="--train-script"):
        example.find_train_script(str(REPO / "no-such-train.py"))


def test_floor_end_to_end(tmp_path, train_module):
    """The CLI as a user runs it (floor only, 6 steps): one table, JSON, PNG, and the floor's exact counts."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run_command([sys.executable, "-m", "deepspeed_xla.bench", "--systems", "floor", "--steps", "6",
                        "--warmup", "3", *TINY, "--grad-accum", "2", "--clip", "1.0", "--skip-bandwidth", "--out",
                        str(out), "--png", str(png), "--workdir", str(tmp_path / "work")], 600, cwd=REPO,
                       env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"command", "model", "steps", "warmup", "repeats", "device", "cpus", "zero_options",
                           "systems", "bandwidth", "zero3_partition", "workdir", "load_average", "targets"}
    (floor,) = report["systems"]
    assert floor["compilations_after_warmup"] == 0
    assert floor["executions_per_step"] == 1.0
    assert floor["transfers_per_step"] == 0.0
    params = sum(p.numel() for p in train_module.TinyGPT(64, 32, 2, seq=16).parameters())
    # the parameters and AdamW's two moments, in float32 (and AdamW's step counts, on the host); on the device
    # besides them only the six losses and the last batch
    assert 12 * params <= floor["state_bytes_per_rank"] <= 12 * params + 4 * 64
    assert 12 * params <= floor["device_bytes_per_rank"] <= 12 * params + 4096
    assert floor["ratio_to_floor"] == 1.0 and floor["median_step_s"] > 0
    assert floor["tokens_per_s"] == pytest.approx(2 * 4 * 16 / floor["median_step_s"])  # 2 micro-batches a step
    assert "floor" in proc.stdout and "met     floor executions per step" in proc.stdout
    # Host and device time (bench.clock): each step's graph starts executing when the host's part (tracing) ends and
    # finishes before the step does; the process started before the first step and the bench launched it before
    # that (process start times count in 10 ms ticks).
    record = json.loads((tmp_path / "work" / "floor.json").read_text())
    for step, trace, execute in zip(record["step_times"], record["trace_times"], record["execute_times"]):
        assert 0 < trace and 0 < execute and trace + execute <= step + 1e-3, (step, trace, execute)
    assert 0 < floor["trace_s"] < floor["median_step_s"] and 0 < floor["execute_s"] < floor["median_step_s"]
    assert floor["trace_ratio_to_floor"] == 1.0 and floor["step_cpu_s"] > 0
    assert floor["start_to_first_step_s"] >= floor["first_step_s"] > 0
    assert floor["launch_to_first_step_s"] >= floor["start_to_first_step_s"] - 0.02
    assert 0 < floor["first_step_cpu_s"] < floor["cpu_s"]
    assert "trace ms" in proc.stdout and "start->1st step end s" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# The features that run code of scripts/train.py's own (a flag, or its data ranks under AutoTP), each once at its
# smallest process count (zinit on 2: its collectives run inside zero.Init). hpZ, ZeRO-Offload, the monitors and the
# profiler are config sections only (test_feature_configs_and_flags, test_feature_outputs_go_to_the_systems_folder),
# trained on XLA by tests/launched/test_parallelism.py, test_fragment_api.py and test_features.py; a bench system
# costs 40-120 s here under the suite's load (three interpreters start, and the first two steps compile), so they
# are left out.
FEATURE_SYSTEMS = ["xla-zero1-2p-moe", "xla-zero1-2p-sp", "xla-zero1-2p-tp", "xla-zero0-1p-ckpt",
                   "xla-zero0-1p-compile", "xla-zero3-2p-zinit"]


def test_feature_systems_end_to_end(tmp_path):
    """One bench run of the feature systems on a 1-layer TinyGPT, 6 steps: each trains (finite, falling losses),
    compiles nothing after warm-up and reports its counters; and the features visibly applied: AutoTP holds half of
    the attention's qkv on a rank, MoE's experts are parameters, engine.compile() runs graphs of its own, zero.Init
    built every parameter partitioned over the 2 ranks (which broadcast them from rank 0 as they are built)."""
    out, work = tmp_path / "bench.json", tmp_path / "work"
    proc = run_command([sys.executable, "-m", "deepspeed_xla.bench", "--systems", *FEATURE_SYSTEMS, "--steps", "6",
                        "--warmup", "3", "--dim", "16", "--layers", "1", "--seq", "16", "--batch", "4",
                        "--skip-bandwidth", "--out", str(out), "--workdir", str(work)], 1200, cwd=REPO,
                       env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    rows = {row["system"]: row for row in json.loads(out.read_text())["systems"]}
    assert list(rows) == FEATURE_SYSTEMS
    for name, row in rows.items():
        losses = json.loads((work / f"{name}.json").read_text())["losses"]
        assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], (name, losses)
        assert row["compilations_after_warmup"] == 0, name
        assert row["executions_per_step"] >= 1 and row["transfers_per_step"] >= 0, name
        assert 0 < row["trace_s"] <= row["median_step_s"] and row["execute_s"] > 0, name
        assert row["start_to_first_step_s"] >= row["first_step_s"] > 0, name
        assert f"met     {name} compilations after warm-up" in proc.stdout
    tp_params = json.loads((work / "xla-zero1-2p-tp.json").read_text())["params"]
    assert len(tp_params["blocks.0.qkv.weight"]) == 3 * 16 // 2
    moe_params = json.loads((work / "xla-zero1-2p-moe.json").read_text())["params"]
    assert any(".experts." in name for name in moe_params)
    assert rows["xla-zero0-1p-compile"]["executions_per_step"] > 1  # a plain ZeRO-0 step is one graph
    zinit_params = json.loads((work / "xla-zero3-2p-zinit.json").read_text())["params"]
    sizes = [torch.tensor(values).numel() for values in zinit_params.values()]
    held = sum(-(-size // 2) for size in sizes)  # each parameter's partition on one of the 2 ranks
    assert (f"zero.Init built {sum(sizes):,} parameters partitioned, {held:,} held on rank 0"
            in (work / "xla-zero3-2p-zinit.log").read_text())
