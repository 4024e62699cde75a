"""DeepSpeed features a JSON config or one call turns on, on XLA against DeepSpeed's own CPU accelerator:
activation checkpointing (``deepspeed.checkpointing``), the flops profiler, the monitors (csv, TensorBoard, and wandb
and comet offline), ZeRO-Offload, ``engine.compile()`` and the inference engine. The features XLA cannot run are
refused at ``deepspeed.initialize`` (``tests/launched/test_bad_input.py``).

One process per accelerator trains every case in turn on a tiny model with the same data and seed (and 2 ranks the
one case that needs them, activations partitioned across model-parallel ranks); it writes each case's per-step
losses, final weights and, on XLA, the graph counters after the warm-up steps and at the end. XLA draws dropout masks
from its own generator, not torch's CPU one: a case with dropout is compared with the same model without
checkpointing on the same accelerator (the recomputed forward must draw the masks the first forward drew), and with
the CPU accelerator only without dropout. The model, the cases and the processes that train them:
``features_ranks.py``.
"""
import csv
import json
import struct
import zipfile
import zlib
from pathlib import Path

import pytest

from tests.launched.features_ranks import BATCH, MONITORED, OUT_ENV, STEPS, WARMUP
from tests.multiproc import LOSS_TOLERANCE, PARAM_TOLERANCE, on_both_accelerators, run_rank_records, within


def launch(accelerator: str, out: Path) -> dict:
    return run_rank_records("tests.launched.features_ranks:rank_main", accelerator, 1, out, OUT_ENV)[0]


def launch_partitioned(accelerator: str, out: Path) -> list:
    return run_rank_records("tests.launched.features_ranks:partitioned_main", accelerator, 2, out, OUT_ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(xla, cpu)``: the cases' records, the two processes run concurrently."""
    return on_both_accelerators(launch, tmp_path_factory.mktemp("features"))


def counts_per_step(record: dict) -> dict:
    warm, end = record["counters"]["warm"], record["counters"]["end"]
    steps = record.get("counted_steps", STEPS - WARMUP)  # optimizer steps
    return {key: (end[key] - warm[key]) / (1 if key == "compilations" else steps) for key in end}


def assert_same_training(xla: dict, cpu: dict, params: str = "params") -> None:
    for record in (xla, cpu):
        assert "failed" not in record, record.get("failed")
    assert within(xla["losses"], cpu["losses"], **LOSS_TOLERANCE["float32"]), (xla["losses"], cpu["losses"])
    assert xla[params].keys() == cpu[params].keys()
    for name, values in xla[params].items():
        assert within(values, cpu[params][name], **PARAM_TOLERANCE["float32"]), name


# One graph per step, no host read: the losses stay on the device until the end.
ONE_GRAPH = {"compilations": 0, "executions": 1, "transfers_to_host": 0}


@pytest.mark.parametrize("name", ["checkpointed", "non_reentrant", "memory_options", "synchronized"])
def test_activation_checkpointing_trains_like_cpu_accelerator(runs, name):
    """DeepSpeed's reentrant and non-reentrant ``checkpoint`` with the config's activation_checkpointing options: the
    same losses and weights as the CPU accelerator, and as the model without checkpointing."""
    xla, cpu = runs
    assert_same_training(xla[name], cpu[name])
    assert_same_training(xla[name], cpu["plain"])
    assert counts_per_step(xla[name]) == CHECKPOINTING_GRAPHS[name]


# Per step, after the warm-up. Checkpointing itself keeps the step one graph. ``cpu_checkpointing`` copies each
# checkpointed block's input to the host: one transfer per block, each running the graph that computes it first.
# ``synchronize_checkpoint_boundary`` waits for the device where each block's forward and its recomputation start
# and end, as on CUDA: each wait runs what was traced since the previous one, and the end of one block and the start
# of the next share theirs (3 waits with work in the forward of 2 blocks, 3 in the backward), then the step's rest.
CHECKPOINTING_GRAPHS = {"checkpointed": ONE_GRAPH, "non_reentrant": ONE_GRAPH,
                        "memory_options": {"compilations": 0, "executions": 3, "transfers_to_host": 2},
                        "synchronized": {"compilations": 0, "executions": 7, "transfers_to_host": 0}}


@pytest.mark.parametrize("name", ["offload_zero2", "offload_zero3"])
def test_offload_trains_like_cpu_accelerator(runs, name):
    """ZeRO-Offload: DeepSpeed's CPU Adam steps fp32 copies in host memory (ZeRO-3 also keeps the parameters there):
    the same losses and weights as the CPU accelerator, and as the model trained on the device without offload."""
    xla, cpu = runs
    assert_same_training(xla[name], cpu[name])
    assert_same_training(xla[name], cpu["plain"])
    assert counts_per_step(xla[name]) == OFFLOAD_GRAPHS


# Per step, after the warm-up: what DeepSpeed moves to the host one parameter at a time (each gradient, and on ZeRO-2
# its overflow test and its norm) in one graph and transfer at the end of the backward (``patches/zero.py``), the
# summed norm read after its all-reduce, and the step's graph.
OFFLOAD_GRAPHS = {"compilations": 0, "executions": 3, "transfers_to_host": 2}


@pytest.mark.parametrize("name", ["offload_zero2_accumulated", "offload_zero3_accumulated"])
def test_offload_with_gradient_accumulation_trains_like_cpu_accelerator(runs, name):
    """ZeRO-Offload over 2 micro-steps a step: each micro-step's sums reach the host buffers DeepSpeed accumulates
    in, the same losses and weights as the CPU accelerator; per step, the first micro-step's backward adds one graph
    and one transfer (its sums, at its end) to the boundary's three and two."""
    xla, cpu = runs
    assert_same_training(xla[name], cpu[name])
    assert counts_per_step(xla[name]) == {"compilations": 0, "executions": 4, "transfers_to_host": 3}


@pytest.mark.parametrize("name, reference", [("checkpointed_dropout", "plain_dropout"),
                                             ("non_reentrant_dropout", "plain_dropout")])
def test_recomputed_forward_draws_the_dropout_masks_of_the_first(runs, name, reference):
    """A checkpointed block's recomputed forward must drop what its first forward dropped (DeepSpeed restores the
    accelerator's RNG state around it): the first step's loss and weights equal those of the model without
    checkpointing. XLA's dropout draws from XLA's generator, so the CPU accelerator is no reference here; and the
    later steps draw from another part of XLA's random stream (setting the seed also moves the seed XLA starts its
    next graph from), so only the first step is compared on XLA. On the CPU accelerator the whole run."""
    xla, cpu = runs
    assert_same_training(cpu[name], cpu[reference])
    assert "failed" not in xla[name], xla[name].get("failed")
    assert xla[name]["losses"][0] == pytest.approx(xla[reference]["losses"][0], abs=1e-6)
    for param, values in xla[name]["first_params"].items():
        assert within(values, xla[reference]["first_params"][param], **PARAM_TOLERANCE["float32"]), param
    assert counts_per_step(xla[name]) == CHECKPOINTING_GRAPHS["memory_options" if "checkpointed" in name
                                                              else "non_reentrant"]


def test_flops_profiler_leaves_the_training_alone(runs):
    """The profiled step (inside the warm-up) cuts the graph at every module; the steps after it run as without it."""
    xla, cpu = runs
    assert_same_training(xla["flops_profiler"], cpu["flops_profiler"])
    assert_same_training(xla["flops_profiler"], cpu["plain"])
    assert counts_per_step(xla["flops_profiler"]) == ONE_GRAPH


def test_monitors_write_what_the_cpu_accelerator_writes(runs):
    """csv_monitor, TensorBoard, wandb and comet together: the engine hands them the learning rate each step, a host
    number. Each monitor's files hold what the CPU accelerator's hold, every monitor the same events, one per step, and
    no step reads the device."""
    xla, cpu = runs
    assert_same_training(xla["monitors"], cpu["monitors"])
    assert counts_per_step(xla["monitors"]) == ONE_GRAPH
    written = {accelerator: {monitor: events(read(Path(record["monitors"]["monitor_dir"])))
                             for monitor, read in MONITOR_READERS.items()}
               for accelerator, record in (("xla", xla), ("cpu", cpu))}
    assert written["xla"] == written["cpu"], written
    logged = written["xla"]["csv_monitor"]
    assert list(logged) == ["Train_Samples_lr"], logged
    assert [step for step, _ in logged["Train_Samples_lr"]] == [BATCH * (step + 1) for step in range(STEPS)], logged
    assert len({value for _, value in logged["Train_Samples_lr"]}) == STEPS, logged  # the warm-up: every value differs
    for monitor, held in written["xla"].items():  # TensorBoard holds float32 numbers
        assert held.keys() == logged.keys(), (monitor, held)
        for name, points in held.items():
            assert within(points, logged[name], atol=0.0, rtol=1e-6), (monitor, name, points)


def events(logged) -> dict:
    """``{name: [[step, value], ...]}`` of the ``(name, step, value)`` a monitor holds, named as csv_monitor names its
    files ("/" -> "_"); only DeepSpeed's events (``Train/...``), not what a monitor logs of its own (wandb's ``_step``,
    comet's ``process duration``)."""
    held = {}
    for name, step, value in logged:
        if name.replace("/", "_").startswith("Train_"):
            held.setdefault(name.replace("/", "_"), []).append([step, value])
    return held


def csv_events(folder: Path):
    for path in sorted(folder.rglob("*.csv")):
        header, *rows = csv.reader(path.open())
        assert header[0] == "step", (path, header)
        yield from ((path.stem, int(step), float(value)) for step, value in rows)


def tensorboard_events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(folder / MONITORED["tensorboard"]["job_name"])).Reload()
    for tag in accumulator.Tags()["scalars"]:
        yield from ((tag, event.step, event.value) for event in accumulator.Scalars(tag))


def wandb_events(folder: Path):
    """The history of the offline run, from its ``.wandb`` file: wandb 0.31 has no Python reader of it (its Go core
    writes and syncs it), so the file's LevelDB-log framing is undone here (checksums checked) and each record parsed
    with wandb's own protobuf. The run must have been finished (its exit record)."""
    from wandb.proto.wandb_internal_pb2 import Record
    (run_file, ) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]  # ident, magic, version 0
    records, chunk, position, block, header = [], b"", 7, 32768, 7
    while position + header <= len(data):
        if block - position % block < header:  # a block's tail too short for a record header is padding
            position += block - position % block
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, position)
        payload = data[position + header:position + header + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == checksum, (run_file, position)
        chunk, position = chunk + payload, position + header + length
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(Record.FromString(chunk))
            chunk = b""
    kinds = [record.WhichOneof("record_type") for record in records]
    assert "exit" in kinds, kinds
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            yield from ((key, row["_step"], value) for key, value in row.items())


def comet_events(folder: Path):
    """The metric messages of the offline experiment's archive (written when it ends)."""
    (archive, ) = (folder / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as opened:
        messages = [json.loads(line) for line in opened.read("messages.json").splitlines()]
    for message in messages:
        if message["type"] == "metric_msg":
            metric = message["payload"]["metric"]
            yield metric["metricName"], metric["step"], metric["metricValue"]


MONITOR_READERS = {"csv_monitor": csv_events, "tensorboard": tensorboard_events, "wandb": wandb_events,
                   "comet": comet_events}


def test_engine_compile_trains_like_the_uncompiled_model(runs):
    """``engine.compile()`` with the accelerator's backend (``openxla``): torch.compile hands the forward and
    backward graphs to XLA; the same losses and weights as the CPU accelerator without compilation."""
    xla, cpu = runs
    assert_same_training(xla["compiled"], cpu["plain"])
    assert counts_per_step(xla["compiled"]) == COMPILED_GRAPHS


# torch.compile's openxla backend runs each graph Dynamo hands it when it is called (the parameters the last step
# updated are run first, as its inputs), then the forward, the backward and the optimizer step: 4 per step, none
# compiled again.
COMPILED_GRAPHS = {"compilations": 0, "executions": 4, "transfers_to_host": 0}


def test_inference_engine_computes_what_the_cpu_accelerator_computes(runs):
    """``deepspeed.init_inference`` without kernel injection: each batch's loss as on the CPU accelerator; reading it
    runs the batch's one graph."""
    xla, cpu = runs
    for record in (xla["inference"], cpu["inference"]):
        assert "failed" not in record, record.get("failed")
    assert within(xla["inference"]["losses"], cpu["inference"]["losses"], **LOSS_TOLERANCE["float32"])
    assert counts_per_step(xla["inference"]) == {"compilations": 0, "executions": 1, "transfers_to_host": 1}


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory):
    """``(xla, cpu)``: each a list of the 2 ranks' records, the two launches run concurrently."""
    return on_both_accelerators(launch_partitioned, tmp_path_factory.mktemp("partitioned"))


def test_activations_partitioned_across_model_parallel_ranks(partitioned, runs):
    """``partition_activations`` with an ``mpu`` of 2 ranks: each rank keeps half of each checkpointed input and the
    recomputation all-gathers it (through host memory on PJRT CPU). Both ranks train as the CPU accelerator's ranks
    and as one process."""
    (xla, cpu), (_, one_process) = partitioned, runs
    for mine, theirs in zip(xla, cpu, strict=True):
        assert_same_training(mine, theirs)
        assert_same_training(mine, one_process["plain"])
        assert counts_per_step(mine) == PARTITIONED_GRAPHS


# Per step: a 2-rank ZeRO-0 step's 3 (tests/launched/test_multiprocess_training.py), and for each of the 2 blocks the
# graph run before its input is copied to the host (cpu_checkpointing) and the one run before the all-gather of its
# partitions (each staged collective runs the graph computing its operand first).
PARTITIONED_GRAPHS = {"compilations": 0, "executions": 3 + 2 + 2, "transfers_to_host": 2}
