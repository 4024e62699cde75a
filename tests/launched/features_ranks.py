"""The rank side of ``test_features.py``: the tiny model, the cases (each a DeepSpeed config and how the model runs)
and the processes that train them in turn on one accelerator (``rank_main``; ``partitioned_main`` on 2 ranks) and
write each case's record."""
import json
import os
import traceback
from pathlib import Path

import torch

STEPS, WARMUP, BATCH, WIDTH = 6, 3, 4, 8
OUT_ENV = "DSX_TEST_FEATURES_OUT"
# The config's activation_checkpointing sections: the options that keep fewer activations on the device (one process
# without model-parallel ranks: a partition is the whole activation), and those that synchronize and time each
# checkpoint. ``contiguous_memory_optimization`` fails in DeepSpeed 0.19.8's partition_activations on its CPU
# accelerator as on XLA (IndexError), so it is in neither.
MEMORY_OPTIONS = {"partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 2}
SYNCHRONIZED = {"synchronize_checkpoint_boundary": True, "profile": True}
# DeepSpeed's four monitors in one config, as its MonitorMaster drives them, writing under the case's folder ("MONITOR";
# wandb and comet through their environment: ``offline_monitors``), the learning rate warming up so that each step logs
# another value. Comet logs an event when ``samples_log_interval`` samples have passed since it last logged it: every
# step here.
MONITORED = {"csv_monitor": {"enabled": True, "output_path": "MONITOR", "job_name": "features"},
             "tensorboard": {"enabled": True, "output_path": "MONITOR", "job_name": "features"},
             "wandb": {"enabled": True, "project": "features"},
             "comet": {"enabled": True, "online": False, "project": "features", "samples_log_interval": BATCH},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": STEPS}}}


def config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": 0}, "steps_per_print": 1000, **extra}


# name: (DeepSpeed config extras, how the blocks run: None, "reentrant" or "non_reentrant", dropout, engine.compile())
CASES = {
    "plain": ({}, None, 0.0, False),
    "checkpointed": ({"activation_checkpointing": {}}, "reentrant", 0.0, False),
    "non_reentrant": ({"activation_checkpointing": {}}, "non_reentrant", 0.0, False),
    "memory_options": ({"activation_checkpointing": MEMORY_OPTIONS}, "reentrant", 0.0, False),
    "synchronized": ({"activation_checkpointing": SYNCHRONIZED}, "reentrant", 0.0, False),
    "plain_dropout": ({}, None, 0.25, False),
    "checkpointed_dropout": ({"activation_checkpointing": MEMORY_OPTIONS}, "reentrant", 0.25, False),
    "non_reentrant_dropout": ({"activation_checkpointing": {}}, "non_reentrant", 0.25, False),
    "flops_profiler": ({"flops_profiler": {"enabled": True, "profile_step": 2}}, None, 0.0, False),
    "monitors": (MONITORED, None, 0.0, False),
    "compiled": ({}, None, 0.0, True),
    "offload_zero2": ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, None, 0.0, False),
    "offload_zero2_accumulated": ({"gradient_accumulation_steps": 2, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}, None, 0.0, False),
    "offload_zero3": ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                             "offload_param": {"device": "cpu"}}}, None, 0.0, False),
    "offload_zero3_accumulated": ({"gradient_accumulation_steps": 2, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}, None, 0.0, False),
}


class Block(torch.nn.Module):
    """A residual MLP block (linear, GELU, dropout, linear): the unit DeepSpeed's ``checkpoint`` recomputes. The
    residual is inside: with ``partition_activations`` DeepSpeed replaces a checkpointed block's input by its
    partition, so a model must not reuse that tensor after the call (as Megatron's transformer layers do not)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x):
        return x + self.mlp(x)


class Net(torch.nn.Module):
    """An input layer, two blocks, optionally checkpointed, and a head. The input layer makes the first block's input
    require a gradient, as DeepSpeed's reentrant ``checkpoint`` needs to give the block's parameters one."""

    def __init__(self, checkpointing, dropout: float):
        super().__init__()
        self.embed = torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(Block(dropout) for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, 1)
        self.checkpointing = checkpointing

    def forward(self, x, y):
        from deepspeed import checkpointing
        run = {None: lambda block, h: block(h), "reentrant": checkpointing.checkpoint,
               "non_reentrant": checkpointing.non_reentrant_checkpoint}[self.checkpointing]
        x = self.embed(x)
        for block in self.blocks:
            x = run(block, x)
        return torch.nn.functional.mse_loss(self.head(x), y)


def batch(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def graph_counters() -> dict:
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "xla":
        return {}
    from deepspeed_xla.xla_runtime import graph_counters as counters
    return counters()


def train(name: str, workdir: Path, mpu=None) -> dict:
    import deepspeed
    extra, checkpointing, dropout, compiled = CASES[name]
    ds_config = json.loads(json.dumps(config(**extra)).replace("MONITOR", str(workdir / name)))
    monitored = extra is MONITORED
    if monitored:
        offline_monitors(workdir / name)
    torch.manual_seed(1234)
    deepspeed.get_accelerator().manual_seed(1234)
    model = Net(checkpointing, dropout)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    if checkpointing:
        deepspeed.checkpointing.configure(mpu, deepspeed_config=ds_config)
    if compiled:
        engine.compile()
    losses, counters, first_params = [], {}, None
    accumulation = engine.gradient_accumulation_steps()  # a "step" of the loop is a micro-step
    warm_at = -(-WARMUP // accumulation) * accumulation  # counted from the start of an optimizer step
    for step in range(STEPS):
        if step == warm_at:
            counters["warm"] = graph_counters()
        x, y = batch(step)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        if step == 0:
            first_params = host_params(engine)
    counters["end"] = graph_counters()
    deepspeed.checkpointing.reset()
    if monitored:
        end_monitor_runs(engine)
    return {"losses": [loss.item() for loss in losses], "counters": counters, "first_params": first_params,
            "counted_steps": (STEPS - warm_at) // accumulation,
            "monitor_dir": str(workdir / name) if monitored else None, "params": host_params(engine)}


def offline_monitors(folder: Path) -> None:
    """wandb and comet write their runs under ``folder`` and reach no server: DeepSpeed's config has no key for wandb's
    mode or either's folder, so their environment says it, before either is imported. Comet's environment details
    would look up its server's address (to report the host's own IP), and both send their own errors to Sentry unless
    told not to (comet sets it up when imported). HOME is the process's own empty folder (``clean_env``), so no login
    or settings of the machine's user are read; wandb's cache folder, where its core writes its logs, would be the
    real one (``clean_env`` keeps XDG_CACHE_HOME for pip's and torch's caches)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(folder), WANDB_CACHE_DIR=str(folder / "wandb-cache"),
                      WANDB_ERROR_REPORTING="false", COMET_OFFLINE_DIRECTORY=str(folder / "comet"),
                      COMET_AUTO_LOG_ENV_DETAILS="false", COMET_ERROR_TRACKING_ENABLE="false")


def end_monitor_runs(engine) -> None:
    """DeepSpeed starts the wandb run and the comet experiment but never ends them (their exit hooks would): end them,
    as a training script does, so that their files are complete before the record says the case is done."""
    import wandb
    wandb.finish()
    engine.monitor.comet_monitor.experiment.end()


def host_params(engine) -> dict:
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {key: value.detach().cpu().flatten().tolist() for key, value in params.items()}


def rank_main() -> None:
    """One process: every case in turn; a case that fails records its traceback."""
    out = Path(os.environ[OUT_ENV])
    results = {}
    import deepspeed
    on_xla = deepspeed.get_accelerator().device_name() == "xla"
    for name, (_, _, _, compiled) in CASES.items():
        if compiled and not on_xla:  # compared with the uncompiled CPU run: inductor would build C++ for minutes
            continue
        try:
            results[name] = train(name, out)
        except Exception:
            results[name] = {"failed": traceback.format_exc()}
    try:
        results["inference"] = infer()
    except Exception:
        results["inference"] = {"failed": traceback.format_exc()}
    Path(f"{out}.rank0").write_text(json.dumps(results))


class WorldModelParallel:
    """An ``mpu`` whose model-parallel group is every rank: each rank holds the same activations, as the ranks of a
    tensor-parallel layer do, and ``partition_activations`` keeps 1/2 of each on each rank, gathering it for the
    recomputation."""

    def get_model_parallel_rank(self) -> int:
        import deepspeed
        return deepspeed.comm.get_rank()

    def get_model_parallel_world_size(self) -> int:
        import deepspeed
        return deepspeed.comm.get_world_size()

    def get_model_parallel_group(self):
        import deepspeed
        return deepspeed.comm.get_world_group()


def partitioned_main() -> None:
    """One of 2 ranks: ``partition_activations`` across them, the same batches on both (data parallelism then
    averages equal gradients: the run is the one-process run)."""
    import deepspeed
    deepspeed.init_distributed()
    out = Path(os.environ[OUT_ENV])
    record = train("memory_options", out, mpu=WorldModelParallel())
    Path(f"{out}.rank{deepspeed.comm.get_rank()}").write_text(json.dumps(record))


def infer() -> dict:
    """``deepspeed.init_inference`` (no kernel injection: DeepSpeed's inference kernels are CUDA) on the model's first
    weights: the loss of each batch, read as it is computed, and the graph counters around the last ones."""
    import deepspeed
    torch.manual_seed(1234)
    engine = deepspeed.init_inference(Net(None, 0.0), dtype=torch.float32)
    device = deepspeed.get_accelerator().current_device_name()
    losses, counters = [], {}
    for step in range(STEPS):
        if step == WARMUP:
            counters["warm"] = graph_counters()
        x, y = batch(step)
        losses.append(engine(x.to(device), y.to(device)).item())
    counters["end"] = graph_counters()
    return {"losses": losses, "counters": counters}
