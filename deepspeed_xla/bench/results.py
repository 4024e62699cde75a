"""From the systems' JSON to the report: table rows, ratios, targets, the printout and the PNG."""
import argparse
import json
import statistics
from pathlib import Path
from typing import List, Optional

from deepspeed_xla.bench import collective_bytes
from deepspeed_xla.bench.cost import step_cost, step_module
from deepspeed_xla.bench.roofline import TPUS, estimate
from deepspeed_xla.bench.systems import System, flops_per_token

RATIO_TARGETS = {0: 1.10, 1: 1.10, 2: 1.10, 3: 1.25}  # step time of xla-zero<stage>-1p over the floor's
TRACE_TARGETS = {0: 1.10, 1: 1.10, 2: 1.10, 3: 1.5}  # the same systems' tracing time over the floor's
BANDWIDTH_TARGET = 0.8  # device all-reduce bandwidth over gloo's
PARTITION_TARGET = 0.55  # ZeRO-3 device bytes per rank, 2 processes over 1
TRAINER_TARGET = 1.10  # step time through the Hugging Face Trainer over scripts/train.py's loop



def steady_median(ranks: List[dict], key: str, warmup: int) -> Optional[float]:
    """The median over the steps after ``warmup`` of the slowest rank's ``key`` (a per-step list); None where a rank
    has no such figure (the Trainer's, or the execute time off XLA)."""
    if not all(rank.get(key) and None not in rank[key] for rank in ranks):
        return None
    return statistics.median([max(values) for values in zip(*(rank[key] for rank in ranks))][warmup:])


def summarize(system: System, ranks: List[dict], args: argparse.Namespace, peak_flops: Optional[float],
              launched: Optional[float] = None) -> dict:
    """One table row from every rank's JSON: a step lasts as long as its slowest rank; counts are the worst rank's;
    tokens count once for the ranks that share a batch (tensor and sequence parallelism). ``launched``: when the
    bench started the system's command (``time.time()``)."""
    median_step = steady_median(ranks, "step_times", args.warmup)
    tokens_per_s = system.data_parallel * args.batch * args.grad_accum * args.seq / median_step
    row = {"system": system.name, "accelerator": system.accelerator, "zero_stage": system.stage,
           "processes": system.procs, "feature": system.feature, "median_step_s": median_step,
           "tokens_per_s": tokens_per_s,
           "peak_rss_bytes": max(rank["peak_rss_bytes"] for rank in ranks), "final_loss": ranks[0]["losses"][-1],
           "state_bytes_per_rank": max(rank["state_bytes"] for rank in ranks),
           "compilations_after_warmup": None, "executions_per_step": None, "transfers_per_step": None,
           "device_bytes_per_rank": None, "mfu": None}
    row.update(host_times(ranks, args.warmup, launched))
    if all(rank["counters"].get("end") for rank in ranks):  # XLA: counters at the end of warm-up and of training
        steady = args.steps - args.warmup
        deltas = [{key: rank["counters"]["end"][key] - rank["counters"]["warm"][key] for key in rank["counters"]["end"]}
                  for rank in ranks]
        row.update(compilations_after_warmup=max(d["compilations"] for d in deltas),
                   executions_per_step=max(d["executions"] for d in deltas) / steady,
                   transfers_per_step=max(d["transfers_to_host"] for d in deltas) / steady,
                   device_bytes_per_rank=max(rank["device_bytes"] for rank in ranks))
        if peak_flops:
            flops = flops_per_token(args.dim, args.layers, args.vocab, args.seq)
            row["mfu"] = flops * tokens_per_s / (system.procs * peak_flops)
    return row


def host_times(ranks: List[dict], warmup: int, launched: Optional[float]) -> dict:
    """``bench.clock``'s figures of a row: per step (medians after warm-up, the slowest rank) the tracing time, the
    device's execute time and the step's CPU; the first step's time, the seconds from the process's
    start (the slowest rank's) and from the bench's launch of the system to the first step's end, the CPU seconds
    of a rank by then, and of all ranks in the whole run. None where the ranks' JSON lacks a figure."""
    times = {field: steady_median(ranks, key, warmup) for field, key in (
        ("trace_s", "trace_times"), ("execute_s", "execute_times"), ("step_cpu_s", "step_cpu_times"))}
    timed = all("first_step_end" in rank for rank in ranks)
    times.update(
        first_step_s=max(rank["step_times"][0] for rank in ranks),
        start_to_first_step_s=max(r["first_step_end"] - r["process_start"] for r in ranks) if timed else None,
        launch_to_first_step_s=max(r["first_step_end"] for r in ranks) - launched if timed and launched else None,
        first_step_cpu_s=max(rank["first_step_cpu"] for rank in ranks) if timed else None,
        cpu_s=sum(rank["cpu_s"] for rank in ranks) if all("cpu_s" in rank for rank in ranks) else None)
    return times


def cost_summary(system: System, dumps: Path, args: argparse.Namespace, graphs_per_step: Optional[float]) -> dict:
    """The ``cost`` object of a row: the step graph's counts (``bench.cost``), the analytic FLOPs of the tokens
    one device trains a step, and the roofline estimate on ``args.tpu``. A step of several graphs
    (``graphs_per_step`` over 1: host-staged collectives cut it on PJRT CPU, ZeRO-3 fetches) is counted in its
    largest graph only, so it gets no estimate: it would leave the other graphs' work out."""
    try:
        module = step_module(dumps)
    except FileNotFoundError as error:
        return {"error": str(error)}
    cost = step_cost(module.read_text())
    tokens = system.data_parallel * args.batch * args.grad_accum * args.seq / system.procs
    model_flops = flops_per_token(args.dim, args.layers, args.vocab, args.seq) * tokens
    whole = graphs_per_step == 1
    return dict(cost, module=str(module), model_flops=model_flops, graphs_per_step=graphs_per_step, tpu=args.tpu,
                estimate=estimate(cost, TPUS[args.tpu], model_flops, system.procs) if whole else None)


def median_run(runs: List[dict]) -> dict:
    """The row of a system's run whose median step time is the median of its ``--repeats`` runs (the lower of the
    middle two), with every run's in ``repeat_step_s``; a failed run's row if one failed."""
    failed = [row for row in runs if "error" in row]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda row: row["median_step_s"])
    return dict(ordered[(len(ordered) - 1) // 2], repeat_step_s=[row["median_step_s"] for row in runs])


def bandwidth_summary(result: dict) -> dict:
    device, gloo = statistics.median(result["device_seconds"]), statistics.median(result["gloo_seconds"])
    return {"bytes": result["bytes"], "backend": result["backend"], "device_gb_per_s": result["bytes"] / device / 1e9,
            "gloo_gb_per_s": result["bytes"] / gloo / 1e9, "ratio": gloo / device}


def zero3_partition(rows: List[dict]) -> Optional[dict]:
    """ZeRO-3's parameter and optimizer-state bytes per rank on 2 processes over 1, and the same for all live
    device buffers (None unless both ran)."""
    by_name = {row["system"]: row for row in rows if "error" not in row}
    one, two = by_name.get("xla-zero3-1p"), by_name.get("xla-zero3-2p")
    if not (one and two):
        return None
    return {"bytes_1_process": one["state_bytes_per_rank"], "bytes_per_rank_2_processes": two["state_bytes_per_rank"],
            "ratio": two["state_bytes_per_rank"] / one["state_bytes_per_rank"],
            "device_bytes_ratio": two["device_bytes_per_rank"] / one["device_bytes_per_rank"]}


FLOOR_RATIOS = {"ratio_to_floor": "median_step_s", "trace_ratio_to_floor": "trace_s",
                "cpu_ratio_to_floor": "step_cpu_s"}


def add_floor_ratios(rows: List[dict]) -> None:
    """Each row's step time, tracing time and CPU time per step over the floor's, where both have them."""
    floor = next((row for row in rows if row["system"] == "floor" and "error" not in row), None)
    for row in rows:
        if floor and "error" not in row:
            for ratio, key in FLOOR_RATIOS.items():
                if row.get(key) is not None and floor.get(key):
                    row[ratio] = row[key] / floor[key]


def add_loop_ratios(rows: List[dict], systems: List[System]) -> None:
    """Each Trainer row's step time over the ``scripts/train.py`` row it is compared with, when both ran."""
    by_name = {row["system"]: row for row in rows if "error" not in row}
    for system in systems:
        row, loop = by_name.get(system.name), by_name.get(system.loop)
        if system.trainer and row and loop:
            row["ratio_to_loop"] = row["median_step_s"] / loop["median_step_s"]
            row["loop"] = system.loop


def check_targets(report: dict) -> List[dict]:
    """Each target of the issue that this run measured: what, the value, the limit, and whether it is met."""
    checks = []

    def check(what: str, value, limit: str, met: bool) -> None:
        checks.append({"what": what, "value": value, "limit": limit, "met": met})

    for row in report["systems"]:
        if "error" in row or row["accelerator"] == "cpu":
            continue
        name, stage = row["system"], row["zero_stage"]
        check(f"{name} compilations after warm-up", row["compilations_after_warmup"], "0",
              row["compilations_after_warmup"] == 0)
        if row.get("feature"):  # the other targets are plain ZeRO's; a feature brings graphs and transfers of its own
            continue
        if row["accelerator"] == "xla" and row["processes"] == 1 and "ratio_to_floor" in row:
            limit = RATIO_TARGETS[stage]
            check(f"{name} step time / floor", row["ratio_to_floor"], f"<= {limit}", row["ratio_to_floor"] <= limit)
            if "trace_ratio_to_floor" in row:
                limit = TRACE_TARGETS[stage]
                check(f"{name} tracing time / floor", row["trace_ratio_to_floor"], f"<= {limit}",
                      row["trace_ratio_to_floor"] <= limit)
        if "ratio_to_loop" in row:
            check(f"{name} step time / {row['loop']}", row["ratio_to_loop"], f"<= {TRAINER_TARGET}",
                  row["ratio_to_loop"] <= TRAINER_TARGET)
        if stage <= 2:
            check(f"{name} executions per step", row["executions_per_step"], "1", row["executions_per_step"] == 1)
        check(f"{name} device->host transfers per step", row["transfers_per_step"], "0",
              row["transfers_per_step"] == 0)
    bandwidth = report.get("bandwidth") or {}
    if "ratio" in bandwidth:
        check(f"all-reduce {bandwidth['bytes'] >> 20} MB, {bandwidth['backend']} / gloo bandwidth", bandwidth["ratio"],
              f">= {BANDWIDTH_TARGET}", bandwidth["ratio"] >= BANDWIDTH_TARGET)
    partition = report.get("zero3_partition")
    if partition:
        check("ZeRO-3 parameter + optimizer bytes per rank, 2 processes / 1", partition["ratio"],
              f"<= {PARTITION_TARGET}",
              partition["ratio"] <= PARTITION_TARGET)
    return checks


def _mb(value: float) -> str:
    return f"{value / 2 ** 20:.2f}"


COLUMNS = [  # header, row key, format of a present value
    ("system", "system", str),
    ("step ms", "median_step_s", lambda v: f"{v * 1e3:.1f}"),
    ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
    ("compiles after warm-up", "compilations_after_warmup", str),
    ("executions/step", "executions_per_step", lambda v: f"{v:.2f}"),
    ("D->H transfers/step", "transfers_per_step", lambda v: f"{v:.2f}"),
    ("peak RSS MB", "peak_rss_bytes", lambda v: f"{v / 2 ** 20:.0f}"),
    ("state MB/rank", "state_bytes_per_rank", _mb),
    ("device MB/rank", "device_bytes_per_rank", _mb),
    ("x floor", "ratio_to_floor", lambda v: f"{v:.2f}"),
    ("x train.py", "ratio_to_loop", lambda v: f"{v:.2f}"),
    ("MFU", "mfu", lambda v: f"{v:.1%}"),
    ("load", "load_average", lambda v: f"{v:.1f}"),
]


def _ms(value: float) -> str:
    return f"{value * 1e3:.1f}"


HOST_COLUMNS = [  # header, row key, format: where each step's time goes, and the start-up
    ("system", "system", str),
    ("step ms", "median_step_s", _ms),
    ("trace ms", "trace_s", _ms),
    ("execute ms", "execute_s", _ms),
    ("step CPU ms", "step_cpu_s", _ms),
    ("trace x floor", "trace_ratio_to_floor", lambda v: f"{v:.2f}"),
    ("step CPU x floor", "cpu_ratio_to_floor", lambda v: f"{v:.2f}"),
    ("1st step s", "first_step_s", lambda v: f"{v:.1f}"),
    ("start->1st step end s", "start_to_first_step_s", lambda v: f"{v:.1f}"),
    ("launch->1st step end s", "launch_to_first_step_s", lambda v: f"{v:.1f}"),
    ("CPU s to 1st step end", "first_step_cpu_s", lambda v: f"{v:.1f}"),
    ("run CPU s", "cpu_s", lambda v: f"{v:.1f}"),
]


COST_COLUMNS = [  # header, key of the row's cost object, format; the estimate's keys are under "estimate"
    ("system", "system", str),
    ("graphs/step", "graphs_per_step", lambda v: f"{v:.2f}"),
    ("dot GFLOP", "dot_flops", lambda v: f"{v / 1e9:.3f}"),
    ("x model FLOPs", "dot_over_model", lambda v: f"{v:.3f}"),
    ("elementwise Mops", "elementwise_ops", lambda v: f"{v / 1e6:.2f}"),
    ("reduction Mops", "reduction_ops", lambda v: f"{v / 1e6:.2f}"),
    ("moved M elements", "movement_elements", lambda v: f"{v / 1e6:.2f}"),
    ("read MB", "bytes_read", _mb),
    ("written MB", "bytes_written", _mb),
    ("collectives", "collective_count", str),
    ("collective MB", "collective_bytes", _mb),
    ("est. step ms", "step_s", lambda v: f"{v * 1e3:.4g}"),
    ("est. MFU", "mfu", lambda v: f"{v:.1%}"),
]


def cost_rows(rows: List[dict]) -> List[dict]:
    """The cost objects of the rows that have one, flattened for ``COST_COLUMNS``."""
    flat = []
    for row in rows:
        cost = row.get("cost")
        if cost and "error" not in cost:
            flat.append(dict(cost, **(cost["estimate"] or {}), system=row["system"],
                             collective_count=len(cost["collectives"]),
                             dot_over_model=cost["dot_flops"] / cost["model_flops"]))
    return flat


def format_table(rows: List[dict], columns: Optional[list] = None) -> str:
    """The rows as a text table; '-' where a system has no such figure, the MFU and train.py columns only where one
    has it."""
    optional = ("mfu", "ratio_to_loop")
    columns = [c for c in columns or COLUMNS if c[1] not in optional or any(row.get(c[1]) is not None for row in rows)]
    cells = [[header for header, _, _ in columns]]
    for row in rows:
        cells.append([fmt(row[key]) if row.get(key) is not None else ("failed" if "error" in row and i == 1 else "-")
                      for i, (_, key, fmt) in enumerate(columns)])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                       for i, (cell, width) in enumerate(zip(line, widths))) for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def render(report: dict) -> str:
    """The whole printout: the setup, the table, the all-reduce and ZeRO-3 figures, the targets."""
    model, load = report["model"], report["load_average"]
    repeats = f", each system's median of {report['repeats']} runs in turn" if report.get("repeats", 1) > 1 else ""
    accum = f" x {model['grad_accum']} micro-batches" if model.get("grad_accum", 1) > 1 else ""
    clip = f", clipped to norm {model['clip']:g}" if model.get("clip") else ""
    lines = [f"TinyGPT dim {model['dim']}, {model['layers']} layers, seq {model['seq']}, batch {model['batch']}/rank"
             f"{accum}{clip}, vocab {model['vocab']}: {model['flops_per_token']:,} FLOPs/token; {report['steps']} "
             f"steps, medians after {report['warmup']} warm-up{repeats}; PJRT_DEVICE={report['device']}, "
             f"{report['cpus']} CPUs, load average {load['start']:.1f} -> {load['end']:.1f}"]
    if report.get("zero_options"):
        lines[0] += f"; zero_optimization {json.dumps(report['zero_options'])}"
    lines += ["", format_table(report["systems"])]
    timed = [row for row in report["systems"] if row.get("trace_s") is not None]
    if timed:
        lines += ["", "host and device time per step (medians after warm-up; trace: from the step's start until its "
                      "last graph execution started; execute: torch_xla's ExecuteTime; CPU: the process's, all "
                      "threads) and the start-up (from the training process's start, and from the bench's launch of "
                      "the system, to the first step's end):", format_table(timed, HOST_COLUMNS)]
    costs = cost_rows(report["systems"])
    if costs:
        tpu = TPUS[costs[0]["tpu"]]
        lines += ["", f"cost of a step, counted in each system's step graph (HLO before XLA's optimizations); est.: "
                      f"an ESTIMATE on one TPU {tpu.name} chip ({tpu.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, "
                      f"HBM {tpu.hbm_bytes_per_s / 1e9:.0f} GB/s, ICI {tpu.ici_bytes_per_s / 1e9:.0f} GB/s), "
                      "max(FLOPs/peak, bytes/HBM) + collective bytes/ICI, not a measurement; a step of several "
                      "graphs: its largest counted, no estimate",
                  format_table(costs, COST_COLUMNS)]
    lines += collective_bytes.table(report["systems"])
    bandwidth = report.get("bandwidth")
    if bandwidth and "ratio" in bandwidth:
        lines += ["", f"all-reduce of {bandwidth['bytes'] >> 20} MB, 2 processes: {bandwidth['backend']} on the device "
                      f"{bandwidth['device_gb_per_s']:.2f} GB/s, gloo on CPU tensors {bandwidth['gloo_gb_per_s']:.2f} "
                      f"GB/s (ratio {bandwidth['ratio']:.2f})"]
    partition = report.get("zero3_partition")
    if partition:
        lines += [f"ZeRO-3 parameters + optimizer state per rank: {_mb(partition['bytes_1_process'])} MB on 1 "
                  f"process, {_mb(partition['bytes_per_rank_2_processes'])} MB on 2 (ratio {partition['ratio']:.2f}; "
                  f"all live device buffers: ratio {partition['device_bytes_ratio']:.2f})"]
    if report["targets"]:
        lines += ["", "targets:"] + [
            f"  {'met' if t['met'] else 'MISSED':6}  {t['what']}: {t['value']:.3g} (target {t['limit']})"
            for t in report["targets"]]
    failures = [f"{row['system']}: {row['error']}" for row in report["systems"] if "error" in row]
    failures += [f"{row['system']} cost: {row['cost']['error']}" for row in report["systems"]
                 if "error" in row.get("cost", {})]
    if bandwidth and "error" in bandwidth:
        failures.append(f"all-reduce bandwidth: {bandwidth['error']}")
    if failures:
        lines += ["", "failed:"] + failures
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Step time and tokens/s per system as a PNG; matplotlib is imported only here."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg: no display, no pyplot state
    rows = [row for row in report["systems"] if "error" not in row]
    names = [row["system"] for row in rows]
    figure = Figure(figsize=(11, 0.45 * len(rows) + 1.8), layout="constrained")
    times, tokens = figure.subplots(1, 2, sharey=True)
    times.barh(names, [row["median_step_s"] * 1e3 for row in rows], color="tab:blue")
    floor = next((row for row in rows if row["system"] == "floor"), None)
    if floor:
        times.axvline(floor["median_step_s"] * 1e3, color="black", linestyle="--", linewidth=1, label="floor")
        times.legend(loc="lower right")
    times.set(xlabel="median step time (ms)")
    times.invert_yaxis()
    tokens.barh(names, [row["tokens_per_s"] for row in rows], color="tab:green")
    tokens.set(xlabel="tokens/s")
    model = report["model"]
    figure.suptitle(f"TinyGPT d={model['dim']} L={model['layers']} T={model['seq']} B={model['batch']}, "
                    f"PJRT_DEVICE={report['device']}")
    for axes in (times, tokens):
        axes.grid(axis="x", alpha=0.3)
    figure.savefig(path, dpi=100)
