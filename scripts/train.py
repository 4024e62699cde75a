r"""Train a small GPT-style decoder with DeepSpeed; runs unchanged on XLA, CPU or CUDA.

    DS_ACCELERATOR=xla PJRT_DEVICE=CPU deepspeed --num_gpus 2 scripts/train.py --deepspeed_config scripts/configs/zero2.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 scripts/train.py --deepspeed_config scripts/configs/zero2.json
    DS_ACCELERATOR=xla deepspeed --num_gpus 2 scripts/train.py --deepspeed_config scripts/configs/zero1.json \
        --moe-experts 2   # or --sequence-parallel 2, --activation-checkpointing, --compile, --zero-init (ZeRO-3)

Those flags add DeepSpeed's MoE, Ulysses, activation checkpointing, ``engine.compile()`` and ``zero.Init``; AutoTP,
ZeRO++ hpZ, ZeRO-Offload, the monitors and the flops profiler need only config sections (``python -m
deepspeed_xla.bench --systems xla-zero1-2p-tp`` writes one into its work folder; deepspeed_xla/bench/systems.py,
FEATURES).

The data is generated (a noisy modular-arithmetic token stream), so nothing is downloaded. Every rank
draws its own micro-batches from a seeded generator, identically on every accelerator, which is what
lets the tests compare per-step losses across accelerators. ``--losses-out`` writes them, and the trained weights, as JSON.
``--plot loss_curve.png`` draws rank 0's losses (matplotlib) when training ends.
``--save-dir``/``--save-at`` write checkpoints; ``--load-dir`` resumes from the latest one at the step it was saved at.
``--timings`` is how ``python -m deepspeed_xla.bench`` runs it: losses read once at the end, each step waited for.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed
from deepspeed.accelerator import get_accelerator


CLIENT_OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.003, weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),  # no step count: a skip is exact
}
MOE_AUX_LOSS_WEIGHT = 0.01  # the gate's load-balancing loss, weighted as in the Switch Transformer
WARMUP_STEPS = 3  # XLA compiles the step's graphs during the first steps; counters start after them
# Every stage holding a tied layer saves it under the same names; DeepSpeed's universal checkpoint conversion
# (ds_to_universal) keeps the first stage's copies of the parameters named here, else the last stage's (whose
# position table, unused there, never trains).
PIPELINE_CHECKPOINT_INFO = {"universal_checkpoint_info": {
    "universal_checkpoint_version": 0.4, "pipeline_replicated_parameter_patterns": [r"tied_modules\."]}}


def causal_attention(q, k, v):
    """Causal self-attention on [batch, sequence, heads, head width]."""
    return F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)), is_causal=True).transpose(1, 2)


def ulysses_attention(group):
    """Ulysses sequence parallelism: each rank holds a slice of the sequence; DeepSpeed's all-to-all trades it for
    the whole sequence of a slice of the heads around ``causal_attention``, and back."""
    from deepspeed.sequence.layer import DistributedAttention
    return functools.partial(DistributedAttention(causal_attention, group, scatter_idx=2, gather_idx=1),
                             batch_dim_idx=0)


class Experts(nn.Module):
    """DeepSpeed's MoE layer with ``experts`` copies of ``mlp`` and top-1 gating, spread over the most ranks that
    divide both the experts and the world; keeps the gate's load-balancing loss for TinyGPT's."""

    def __init__(self, mlp: nn.Module, experts: int):
        from deepspeed.moe.layer import MoE
        super().__init__()
        ep_size = math.gcd(experts, deepspeed.comm.get_world_size())
        self.moe = MoE(hidden_size=mlp[0].in_features, expert=mlp, num_experts=experts, ep_size=ep_size, k=1)
        self.aux_loss = None

    def forward(self, x):
        out, self.aux_loss, _ = self.moe(x)
        return out


class Block(nn.Module):
    """A pre-norm transformer block. Its shapes follow the layers' (heads of ``dim // heads`` channels), so AutoTP
    can hand each rank a slice of the heads and of the MLP."""

    def __init__(self, dim: int, heads: int, experts: int = 0, attention=causal_attention):
        super().__init__()
        self.head_dim = dim // heads
        self.attention = attention
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        if experts:
            self.mlp = Experts(self.mlp, experts)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(self.ln1(x))
        q, k, v = (z.view(b, t, -1, self.head_dim) for z in qkv.split(qkv.shape[-1] // 3, dim=2))
        x = x + self.proj(self.attention(q, k, v).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT; optionally each MLP a mixture of ``experts``, the sequence split over ``sequence_group`` (Ulysses), and
    each block's activations recomputed in backward (``deepspeed.checkpointing``)."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, seq: int = 16,
                 experts: int = 0, sequence_group=None, activation_checkpointing: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        attention = causal_attention if sequence_group is None else ulysses_attention(sequence_group)
        self.blocks = nn.ModuleList(Block(dim, heads, experts, attention) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.experts = experts
        self.activation_checkpointing = activation_checkpointing
        # the first position this rank's slice of the sequence holds
        self.start = 0 if sequence_group is None else sequence_slice(sequence_group, seq).start

    def forward(self, tokens, targets):
        x = self.tok(tokens) + self.pos[self.start:self.start + tokens.shape[1]]
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.activation_checkpointing else block(x)
        logits = self.head(self.ln(x)).float()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        if self.experts:
            loss = loss + MOE_AUX_LOSS_WEIGHT * sum(block.mlp.aux_loss for block in self.blocks)
        return loss


def sequence_slice(group, seq: int) -> slice:
    """The positions of a ``seq``-long sequence that this rank of the sequence-parallel ``group`` holds."""
    length = seq // deepspeed.comm.get_world_size(group)
    start = deepspeed.comm.get_rank(group) * length
    return slice(start, start + length)


class Embedding(nn.Module):
    """Token + position embedding; with ``as_head`` the same weights score the vocabulary (tied)."""

    def __init__(self, vocab: int, dim: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        nn.init.normal_(self.tok.weight, std=0.02)  # GPT-2's init: keeps the tied head's logits small
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)

    def forward(self, tokens):
        return self.tok(tokens) + self.pos[:tokens.shape[1]]


def tied_head(embedding: Embedding, x):
    return (x @ embedding.tok.weight.t()).float()


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def pipeline_model(args, stages: int):
    """The GPT as DeepSpeed pipeline layers; the embedding is tied between the first and last stage."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    layers = [TiedLayerSpec("embed", Embedding, args.vocab, args.dim, args.seq, tied_weight_attr=["tok.weight"])]
    layers += [LayerSpec(Block, args.dim, 2) for _ in range(args.layers)]
    layers += [LayerSpec(nn.LayerNorm, args.dim),
               TiedLayerSpec("embed", Embedding, args.vocab, args.dim, args.seq, forward_fn=tied_head,
                             tied_weight_attr=["tok.weight"])]
    # Only blocks are recomputed: the embedding's input (token ids) carries no gradient to checkpoint.
    return PipelineModule(layers=layers, loss_fn=lm_loss, num_stages=stages, partition_method="uniform",
                          activation_checkpoint_interval=args.activation_checkpoint_interval,
                          checkpointable_layers=["Block"])


def make_batch(step: int, rank: int, batch: int, seq: int, vocab: int):
    """Token stream x[i+1] = (x[i] * 3 + 1) mod vocab with 10% noise: learnable, deterministic."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    tokens = [start]
    for _ in range(seq):
        tokens.append((tokens[-1] * 3 + 1) % vocab)
    stream = torch.cat(tokens, dim=1)
    noise = torch.rand(stream.shape, generator=gen) < 0.1
    stream = torch.where(noise, torch.randint(0, vocab, stream.shape, generator=gen), stream)
    return stream[:, :-1], stream[:, 1:]


def graph_counters() -> dict:
    """XLA compilations/executions/transfers so far (empty on other accelerators); with DS_XLA_COUNT_COLLECTIVES,
    the collectives issued so far are marked at the same point (deepspeed_xla.comm.accounting)."""
    if get_accelerator().device_name() != "xla":
        return {}
    from deepspeed_xla.comm import accounting
    from deepspeed_xla.xla_runtime import graph_counters as xla_counters
    accounting.mark()
    return xla_counters()


def wait_for_device() -> None:
    """Block until the device finished its queued work; on XLA without cutting the lazy graph."""
    if get_accelerator().device_name() != "xla":
        get_accelerator().synchronize()
        return
    from deepspeed_xla.xla_runtime import wait_device
    wait_device()


def step_clock():
    """The per-step clocks ``--timings`` reports (``deepspeed_xla.bench.clock``); on XLA with the execute time."""
    from deepspeed_xla.bench.clock import StepClock
    if get_accelerator().device_name() != "xla":
        return StepClock()
    from deepspeed_xla.xla_runtime import execution_clock
    return StepClock(execution_clock)


def state_bytes(engine) -> int:
    """Bytes of this rank's parameters and optimizer state as DeepSpeed holds them: ZeRO-3 parameters by their
    partition (``ds_tensor``; a released parameter is empty), ZeRO's fp32 master partitions, the moments."""
    tensors = {}
    for param in engine.module.parameters():
        for held in (param, getattr(param, "ds_tensor", None)):
            if held is not None:
                tensors[id(held)] = held
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps the torch optimizer
    for group in optimizer.param_groups:
        tensors.update((id(param), param) for param in group["params"])
    for state in optimizer.state.values():
        tensors.update((id(value), value) for value in state.values() if torch.is_tensor(value))
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def measurements(engine, step_times, clocks=None) -> dict:
    """Each step's wall time (and ``StepClock.results``), this process's peak RSS and CPU time, its parameter and
    optimizer-state bytes and, on XLA, the bytes of all its live device buffers."""
    device_bytes = None
    if get_accelerator().device_name() == "xla":
        from deepspeed_xla.xla_runtime import live_device_bytes
        device_bytes = live_device_bytes()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"step_times": step_times, **(clocks or {}), "device_bytes": device_bytes,
            "state_bytes": state_bytes(engine), "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux: KiB
            "cpu_s": usage.ru_utime + usage.ru_stime}


def mean_loss(micro_losses) -> float:
    """A step's loss: the mean over its micro-batches (floats, or device tensors that are read here)."""
    return sum(float(loss) / len(micro_losses) for loss in micro_losses)


def resume(engine, load_dir: str) -> int:
    """Load the latest checkpoint in ``load_dir``; returns the step to continue from: the one this script saved,
    else (a checkpoint saved on SIGTERM, which holds no client state) the engine's optimizer step count."""
    load_path, client_state = engine.load_checkpoint(load_dir)
    if load_path is None:
        raise SystemExit(f"--load-dir {load_dir}: no 'latest' checkpoint there; "
                         "pass a directory written by --save-dir or DS_XLA_CHECKPOINT_ON_SIGTERM.")
    return client_state.get("step", engine.global_steps)


def plot_losses(losses, first_step: int, title: str, path: str) -> None:
    """Loss per step as a PNG; matplotlib is imported only here, so training never needs it."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg: no display, no pyplot state
    from matplotlib.ticker import MaxNLocator
    figure = Figure(figsize=(6, 4), layout="tight")
    axes = figure.subplots()
    axes.plot(range(first_step, first_step + len(losses)), losses, marker=".")
    axes.set(xlabel="step", ylabel="loss", title=title)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    figure.savefig(path, dpi=100)
    print(f"loss curve: {os.path.abspath(path)}", flush=True)


def host_weights(named_params) -> tuple:
    """``{name: values as nested lists}`` and ``{name: dtype}``, read back in one transfer: on XLA each parameter
    read alone is a graph and an execution of its own (ZeRO's parameters are views into flat buffers)."""
    named = list(named_params)
    if not named:
        return {}, {}
    flat = torch.cat([p.detach().float().flatten() for _, p in named]).cpu()
    parts = flat.split([p.numel() for _, p in named])
    return ({name: part.view(p.shape).tolist() for (name, p), part in zip(named, parts)},
            {name: str(p.dtype).removeprefix("torch.") for name, p in named})


def write_results(engine, losses, path: str, counters: dict, first_step: int = 0, measured=None) -> None:
    """Per-step losses (from ``first_step``), trained weights (as floats, with the dtype each is held in), XLA graph
    counters and ``measurements`` as JSON (rank r>0 at ``path.rank<r>``)."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        weights, dtypes = host_weights(engine.module.named_parameters())
    rank = engine.global_rank
    with open(path if rank == 0 else f"{path}.rank{rank}", "w") as handle:
        json.dump({"losses": losses, "first_step": first_step, "world_size": engine.world_size, "rank": rank,
                   "counters": counters, "skipped_steps": engine.skipped_steps,
                   "accelerator": get_accelerator().device_name(), "params": weights, "param_dtypes": dtypes,
                   **(measured or {})}, handle)


def main(argv=None) -> None:
    """Train once with these command-line arguments (``sys.argv`` by default)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--pipeline-stages", type=int, default=0, help="train as a DeepSpeed PipelineModule")
    parser.add_argument("--activation-checkpoint-interval", type=int, default=0)
    parser.add_argument("--moe-experts", type=int, default=0, metavar="N",
                        help="each block's MLP as N experts (DeepSpeed MoE), over as many ranks as divide N")
    parser.add_argument("--sequence-parallel", type=int, default=1, metavar="N",
                        help="split each sequence over N ranks (DeepSpeed Ulysses); at most the 2 attention heads")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block in backward (deepspeed.checkpointing; the config's "
                             "activation_checkpointing section applies)")
    parser.add_argument("--compile", action="store_true", help="engine.compile(): torch.compile, the accelerator's "
                                                               "backend")
    parser.add_argument("--zero-init", action="store_true", help="build the model inside deepspeed.zero.Init, each "
                        "parameter partitioned as it is made (a ZeRO-3 config)")
    parser.add_argument("--client-optimizer", nargs="?", const="adamw", choices=sorted(CLIENT_OPTIMIZERS),
                        help="build this torch optimizer (default AdamW) before deepspeed.initialize instead of "
                             "using the config's")
    parser.add_argument("--nan-grad-at", type=int, default=None, metavar="STEP",
                        help="make every gradient of this step NaN (DeepSpeed's ZeRO and bf16 optimizers skip it)")
    parser.add_argument("--losses-out", default=None, help="write per-step losses (rank 0) as JSON here")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw rank 0's loss curve into this PNG file")
    parser.add_argument("--save-dir", default=None, help="checkpoint directory for --save-at")
    parser.add_argument("--save-at", type=int, nargs="*", default=[], help="save a checkpoint after these steps")
    parser.add_argument("--save-tag", default=None, help="save every checkpoint under this tag (default: global_stepN)")
    parser.add_argument("--load-dir", default=None, help="resume from the latest checkpoint in this directory")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                        help="steps before the XLA counters (and deepspeed_xla.bench's timings) start")
    parser.add_argument("--read-loss-every-step", action="store_true",
                        help="read each step's loss on the host as it trains (the tests count those reads); by "
                             "default the losses stay on the device until a step prints or training ends: a read in "
                             "every step makes the host wait for the device before it can trace the next step")
    parser.add_argument("--timings", action="store_true",
                        help="keep the losses on the device until training ends and wait for the device at the end "
                             "of every step: step times without per-step device->host transfers")
    parser.add_argument("--save-graphs", metavar="PREFIX",
                        help="save every graph this rank executes as StableHLO into PREFIX.rank<RANK>.0 (torch_xla's "
                             "XLA_SAVE_TENSORS_FILE; python -m deepspeed_xla.bench --tpu-compile compiles them)")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.nan_grad_at is not None and args.pipeline_stages:
        parser.error("--nan-grad-at works on the plain engine only (the pipeline engine runs its own backward)")
    if args.pipeline_stages and (args.moe_experts or args.sequence_parallel > 1 or args.activation_checkpointing
                                 or args.zero_init):
        parser.error("--moe-experts, --sequence-parallel, --activation-checkpointing and --zero-init build TinyGPT, "
                     "not the pipeline's layers (which --activation-checkpoint-interval checkpoints)")
    if args.save_at and not args.save_dir:
        parser.error("--save-at needs --save-dir (where to write the checkpoints)")
    if args.save_graphs:  # read at the first graph; a file per rank, since every rank's device is xla:0
        os.environ.update(XLA_SAVE_TENSORS_FILE=f"{args.save_graphs}.rank{os.environ.get('RANK', '0')}",
                          XLA_SAVE_TENSORS_FMT="stablehlo")

    deepspeed.init_distributed()
    mesh_param = sequence_group = None
    if args.sequence_parallel > 1:  # DeepSpeed's (data, sequence) mesh: a sequence's ranks are consecutive
        mesh_param = (deepspeed.comm.get_world_size() // args.sequence_parallel, args.sequence_parallel)
        mesh = deepspeed.comm.initialize_mesh_device(mesh_param, ("data_parallel", "sequence_parallel"))
        sequence_group = mesh.get_group(mesh_dim="sequence_parallel")
    torch.manual_seed(args.seed)
    if args.pipeline_stages:
        model = pipeline_model(args, args.pipeline_stages)
    else:
        with (deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config) if args.zero_init
              else contextlib.nullcontext()):
            model = TinyGPT(args.vocab, args.dim, args.layers, seq=args.seq, experts=args.moe_experts,
                            sequence_group=sequence_group, activation_checkpointing=args.activation_checkpointing)
        if args.zero_init and deepspeed.comm.get_rank() == 0:
            print(f"zero.Init built {sum(p.ds_numel for p in model.parameters()):,} parameters partitioned, "
                  f"{sum(p.ds_tensor.numel() for p in model.parameters()):,} held on rank 0", flush=True)
    params = list(model.parameters())
    if args.moe_experts:  # ZeRO keeps the experts' parameters apart: they are data-parallel over fewer ranks
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "parameters"})
    optimizer = CLIENT_OPTIMIZERS[args.client_optimizer](params) if args.client_optimizer else None
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=params, optimizer=optimizer,
                                           mesh_param=mesh_param)
    if args.activation_checkpointing:
        deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)
    if args.compile:
        engine.compile()
    pipelined = args.pipeline_stages > 0
    rank = engine.global_rank
    # Ranks of one tensor- or sequence-parallel group train on the same batch: it is drawn for their data rank.
    data_rank = (engine.grid.get_data_parallel_rank() if pipelined
                 else deepspeed.comm.get_rank(group=engine.data_parallel_group))
    positions = slice(None) if sequence_group is None else sequence_slice(sequence_group, args.seq)
    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()
    first_step = resume(engine, args.load_dir) if args.load_dir else 0

    def batches(step):
        for micro_step in range(accum):
            tokens, targets = make_batch(step * accum + micro_step, data_rank, micro, args.seq, args.vocab)
            yield tokens[:, positions].to(engine.device), targets[:, positions].to(engine.device)

    each_step = args.read_loss_every_step and not args.timings
    read = (lambda loss: loss.item()) if each_step else (lambda loss: loss.detach())
    step_losses, clock, start, counters = [], step_clock(), time.time(), {}
    for step in range(first_step, args.steps):
        if step - first_step == args.warmup_steps:
            counters["warm"] = graph_counters()
        clock.start()
        if pipelined:
            micro_losses = [read(engine.train_batch(data_iter=batches(step)))]  # already the batch's mean
        else:
            micro_losses = []
            for tokens, targets in batches(step):
                loss = engine(tokens, targets)
                engine.backward(loss * float("nan") if step == args.nan_grad_at else loss)
                engine.step()
                micro_losses.append(read(loss))
        clock.traced()  # the host's part is done (on XLA the clock reads when the step's graph started instead)
        if args.timings:
            wait_for_device()
        clock.end()
        step_losses.append(micro_losses)
        if rank == 0 and not args.timings and (step % 5 == 0 or step == args.steps - 1):
            step_loss = mean_loss(micro_losses)
            done = step + 1 - first_step
            tokens_per_s = done * accum * micro * args.seq * engine.dp_world_size / (time.time() - start)
            print(f"step {step:4d}  loss {step_loss:.4f}  tokens/s {tokens_per_s:,.0f}  "
                  f"device {get_accelerator().current_device_name()}", flush=True)
        if step + 1 in args.save_at:
            engine.save_checkpoint(args.save_dir, tag=args.save_tag,
                                   client_state={"step": step + 1, **(PIPELINE_CHECKPOINT_INFO if pipelined else {})})

    if args.steps - first_step > args.warmup_steps:
        counters["end"] = graph_counters()
    # measured before the losses are read
    measured = measurements(engine, clock.times["step_times"], clock.results()) if args.losses_out else None
    losses = [mean_loss(micro) for micro in step_losses]
    if args.losses_out:
        write_results(engine, losses, args.losses_out, counters, first_step, measured)
    if args.plot and rank == 0:
        plot_losses(losses, first_step, f"TinyGPT, {engine.world_size} x {get_accelerator().device_name()}, "
                    f"{os.path.basename(args.deepspeed_config or 'config')}", args.plot)
    assert all(math.isfinite(x) for x in losses), f"non-finite loss: {losses}"


if __name__ == "__main__":
    main()
