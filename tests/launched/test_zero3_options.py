"""ZeRO-3's tuning options on 2 XLA ranks against DeepSpeed's own CPU accelerator: prefetch bucket, live parameters,
reuse distance, persistence threshold, module granularity threshold, leaf modules, the 16-bit model save, optimizer
sub-groups smaller than the model, and fetching parameters by all-reduce or one at a time.

One 2-rank job per accelerator trains every case in turn (as tests/launched/test_parallelism.py does) on a tiny model
of three blocks with the same data and seed; each rank records its per-step losses, its final weights, which modules
ZeRO-3 treats as leaves and, on XLA, the graph counters after each step from the warm-up on.
"""
import os
from pathlib import Path

import pytest
import torch

from tests.multiproc import PARAM_TOLERANCE, record_cases, records_on_both_accelerators, trained_alike, within

WORLD, STEPS, WARMUP = 2, 6, 3
CLASSES, HIDDEN, BLOCKS, SEQ, BATCH = 64, 8, 3, 4, 2
OUT_ENV = "DSX_TEST_ZERO3_OPTIONS_OUT"
# DeepSpeed's granularity of a module is its parameter count over (1 + its layers): 93 for a Block (280 parameters,
# 2 Linear layers), 124 for the whole model (1488 parameters, 11 layers). A threshold makes each first module in
# pre-order at or under it a leaf, gathered and released as one (``LEAVES`` checks which did).
BLOCK_GRANULARITY, MODEL_PARAMETERS = 93, 1488


class Block(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class BlockModel(torch.nn.Module):
    """Takes features that require a gradient: a ZeRO-3 leaf module needs one among its inputs to gather its
    parameters again for the backward, and with the largest threshold the whole model is the leaf."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, features, targets):
        x = self.inp(features)
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(self.out(x).view(-1, CLASSES), targets.view(-1))


def zero3(**options) -> dict:
    """ZeRO-3 gathering and releasing every parameter (persistence 0) unless ``options`` say otherwise."""
    return {"stage": 3, "stage3_param_persistence_threshold": 0, **options}


# Each case: its "zero_optimization" section, and the block class made a leaf with set_z3_leaf_modules.
CASES = {
    "prefetch-0": (zero3(stage3_prefetch_bucket_size=0), False),
    "prefetch-small": (zero3(stage3_prefetch_bucket_size=2 * HIDDEN * HIDDEN), False),
    "defaults": (zero3(), False),
    "live-parameters-0": (zero3(stage3_max_live_parameters=0), False),
    "reuse-distance-0": (zero3(stage3_max_reuse_distance=0), False),
    "persistence-default": ({"stage": 3}, False),
    "granularity-0": (zero3(stage3_module_granularity_threshold=0), False),
    "granularity-blocks": (zero3(stage3_module_granularity_threshold=BLOCK_GRANULARITY), False),
    "granularity-model": (zero3(stage3_module_granularity_threshold=10 * MODEL_PARAMETERS), False),
    "leaf-blocks": (zero3(stage3_max_reuse_distance=0), True),
    "gather-16bit-save": (zero3(stage3_gather_16bit_weights_on_model_save=True), False),
    "sub-groups": (zero3(sub_group_size=MODEL_PARAMETERS // 8), False),
    "all-reduce-fetch": (zero3(stage3_use_all_reduce_for_fetch_params=True), False),
    "allgather-sequential": (zero3(stage3_allgather_sequential=True), False),
}
# The modules each case must run as ZeRO-3 leaves (the rest: none).
LEAVES = {"granularity-blocks": [f"blocks.{i}" for i in range(BLOCKS)], "granularity-model": [""],
          "leaf-blocks": [f"blocks.{i}" for i in range(BLOCKS)]}


def batches(rank: int):
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        yield torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randint(0, CLASSES, (BATCH, SEQ), generator=gen)


def saved_16bit_model(engine, case: str) -> dict:
    """``engine.save_16bit_model``'s file, which rank 0 writes after every rank gathered its partitions; {} elsewhere."""
    folder = Path(f"{os.environ[OUT_ENV]}-{case}")
    assert engine.save_16bit_model(str(folder)), "save_16bit_model saved nothing"
    if engine.global_rank != 0:
        return {}
    state = torch.load(folder / "pytorch_model.bin", map_location="cpu")
    return {name: value.float().flatten().tolist() for name, value in state.items()}


def train(case: str) -> dict:
    """Case ``case``'s losses, this rank's final weights (gathered), its leaf modules and, on XLA, the graph counters
    after the warm-up and after every later step, the graphs its ``engine.step()`` calls compiled, and whether each
    step's loss was still unexecuted after the backward. Losses are read after the counters: the steps must not read
    the device."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import groups, set_z3_leaf_modules, z3_leaf_module
    from deepspeed_xla.xla_runtime import graph_counters, pending
    on_xla = get_accelerator().device_name() == "xla"
    zero, leaf_blocks = CASES[case]
    torch.manual_seed(0)
    model = BlockModel()
    if leaf_blocks:
        set_z3_leaf_modules(model, [Block])
    config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": zero, "steps_per_print": 1000}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, counters, loss_pending, step_compilations = [], [], [], 0
    for step, (features, targets) in enumerate(batches(engine.global_rank)):
        if on_xla and step >= WARMUP:
            counters.append(graph_counters())
        loss = engine(features.to(engine.device).requires_grad_(), targets.to(engine.device))
        engine.backward(loss)
        if on_xla:
            loss_pending += pending([loss])
            before = graph_counters()["compilations"]
        engine.step()
        if on_xla:
            step_compilations += graph_counters()["compilations"] - before
        losses.append(loss.detach())
    if on_xla:
        counters.append(graph_counters())
    losses = [loss.item() for loss in losses]
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([param for _, param in named]):
        params = {name: param.detach().float().cpu().flatten().tolist() for name, param in named}
    saved = saved_16bit_model(engine, case) if zero.get("stage3_gather_16bit_weights_on_model_save") else None
    leaves = [name for name, module in engine.module.named_modules() if z3_leaf_module(module)]
    engine.destroy()
    groups._release_process_group_references()  # the next case starts from no DeepSpeed groups, as a new process
    return {"losses": losses, "params": params, "counters": counters, "leaves": leaves, "saved": saved,
            "loss_pending": loss_pending, "step_compilations": step_compilations}


def rank_main() -> None:
    """One rank: every case in turn."""
    record_cases(CASES, train, OUT_ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(xla, cpu)``: each a list of per-rank records, the two launches run concurrently."""
    return records_on_both_accelerators(f"{__name__}:rank_main", WORLD, tmp_path_factory.mktemp("zero3_options"), OUT_ENV)


def per_step(counters: list) -> list:
    """The compilations, executions and device->host transfers of each step after the warm-up."""
    return [{key: after[key] - before[key] for key in after} for before, after in zip(counters, counters[1:])]


# PJRT CPU has no XLA collectives, so each host-staged collective (or batch of collectives run together) first runs
# the graph computing its operands (docs/performance.md, "Two processes on PJRT CPU"): how many a step runs depends on
# how ZeRO-3 groups its gathers (a gather per module without prefetching or live parameters), and a step per optimizer
# sub-group (measured).
EXECUTIONS_PER_STEP = {"prefetch-0": 11, "prefetch-small": 7, "defaults": 4, "live-parameters-0": 11,
                       "reuse-distance-0": 4, "persistence-default": 4, "granularity-0": 4, "granularity-blocks": 4,
                       "granularity-model": 4, "leaf-blocks": 4, "gather-16bit-save": 4, "sub-groups": 7,
                       "all-reduce-fetch": 4, "allgather-sequential": 11}


@pytest.mark.parametrize("case", list(CASES))
def test_trains_like_cpu_accelerator(runs, case):
    for rank, (mine, theirs) in enumerate(trained_alike(*runs, case)):
        assert mine["leaves"] == theirs["leaves"] == LEAVES.get(case, []), (rank, mine["leaves"], theirs["leaves"])
        # Nothing compiles after the warm-up, no step reads the device, and every step runs the same graphs.
        steps = per_step(mine["counters"])
        assert len(steps) == STEPS - WARMUP
        assert steps == [{"compilations": 0, "executions": EXECUTIONS_PER_STEP[case], "transfers_to_host": 0}] * len(
            steps), (rank, steps)


def test_each_step_computes_its_loss_with_its_gradients(runs):
    """On XLA the loss is executed by the graph that computes the gradients (the one ZeRO-3's reduce-scatter runs on
    PJRT CPU), not left to the step's graph to compute the forward and the backward again
    (``patches/zero3_reduce.py``)."""
    xla, _ = runs
    for rank, record in enumerate(xla):
        for case in CASES:
            assert record[case].get("loss_pending") == [False] * STEPS, (rank, case, record[case].get("failed"))


@pytest.mark.parametrize("case", ["granularity-blocks", "granularity-model", "leaf-blocks"])
def test_leaves_compile_no_step_graph_of_their_own(runs, case):
    """ZeRO-3 leaves change how the parameters are gathered, not the optimizer's step: a case with leaves compiles no
    graph in its ``engine.step()`` calls, whose graphs threshold 0 (trained earlier in the same processes) compiled.
    DeepSpeed's own ``test_finegrained_optimization`` trains threshold 0 and then a larger one in the same processes
    the same way (docs/configuration.md)."""
    assert list(CASES).index("granularity-0") < list(CASES).index(case)
    xla, _ = runs
    for rank, record in enumerate(xla):
        assert record[case].get("step_compilations") == 0, (rank, record[case].get("failed"))


def test_16bit_save_holds_the_trained_weights(runs):
    """With ``stage3_gather_16bit_weights_on_model_save``, rank 0's saved model is the whole trained model: the
    gathered weights of the same run, and the CPU accelerator's file within the training tolerance."""
    xla, cpu = runs
    for ranks in (xla, cpu):
        record = ranks[0]["gather-16bit-save"]
        assert record["saved"] == record["params"]
    for name, values in xla[0]["gather-16bit-save"]["saved"].items():
        assert within(values, cpu[0]["gather-16bit-save"]["saved"][name], **PARAM_TOLERANCE["float32"]), name
