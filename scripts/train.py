"""Train a small GPT-style decoder with DeepSpeed; runs unchanged on XLA, CPU or CUDA.

    DS_ACCELERATOR=xla PJRT_DEVICE=CPU deepspeed --num_gpus 2 scripts/train.py --deepspeed_config scripts/configs/zero2.json
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 scripts/train.py --deepspeed_config scripts/configs/zero2.json

The data is generated (a noisy modular-arithmetic token stream), so nothing is downloaded. Every rank
draws its own micro-batches from a seeded generator, identically on every accelerator, which is what
lets the tests compare per-step losses across accelerators. ``--losses-out`` writes them, and the trained weights, as JSON.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed
from deepspeed.accelerator import get_accelerator


WARMUP_STEPS = 3  # XLA compiles the step's graphs during the first steps; counters start after them


class Block(nn.Module):

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2, seq: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, targets):
        x = self.tok(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


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
    """XLA compilations/executions/transfers so far (empty on other accelerators)."""
    if get_accelerator().device_name() != "xla":
        return {}
    from deepspeed_xla.xla_runtime import graph_counters as xla_counters
    return xla_counters()


def write_results(engine, losses, path: str, counters: dict) -> None:
    """Per-step losses, trained weights and XLA graph counters as JSON (rank r>0 at ``path.rank<r>``)."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        weights = {name: p.detach().float().cpu().tolist() for name, p in engine.module.named_parameters()}
    rank = engine.global_rank
    with open(path if rank == 0 else f"{path}.rank{rank}", "w") as handle:
        json.dump({"losses": losses, "world_size": engine.world_size, "rank": rank, "counters": counters,
                   "accelerator": get_accelerator().device_name(), "params": weights}, handle)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--pipeline-stages", type=int, default=0, help="train as a DeepSpeed PipelineModule")
    parser.add_argument("--activation-checkpoint-interval", type=int, default=0)
    parser.add_argument("--client-optimizer", action="store_true",
                        help="build torch.optim.AdamW before deepspeed.initialize instead of using the config's")
    parser.add_argument("--losses-out", default=None, help="write per-step losses (rank 0) as JSON here")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    if args.pipeline_stages:
        model = pipeline_model(args, args.pipeline_stages)
    else:
        model = TinyGPT(args.vocab, args.dim, args.layers, seq=args.seq)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.003, weight_decay=0.01) if args.client_optimizer else None
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=params, optimizer=optimizer)
    pipelined = args.pipeline_stages > 0
    rank = engine.global_rank
    data_rank = engine.grid.get_data_parallel_rank() if pipelined else rank
    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()

    def batches(step):
        for micro_step in range(accum):
            tokens, targets = make_batch(step * accum + micro_step, data_rank, micro, args.seq, args.vocab)
            yield tokens.to(engine.device), targets.to(engine.device)

    losses, start, counters = [], time.time(), {}
    for step in range(args.steps):
        if step == WARMUP_STEPS:
            counters["warm"] = graph_counters()
        if pipelined:
            step_loss = engine.train_batch(data_iter=batches(step)).item()
        else:
            step_loss = 0.0
            for tokens, targets in batches(step):
                loss = engine(tokens, targets)
                engine.backward(loss)
                engine.step()
                step_loss += loss.item() / accum
        losses.append(step_loss)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            tokens_per_s = (step + 1) * accum * micro * args.seq * engine.dp_world_size / (time.time() - start)
            print(f"step {step:4d}  loss {step_loss:.4f}  tokens/s {tokens_per_s:,.0f}  "
                  f"device {get_accelerator().current_device_name()}", flush=True)

    if args.steps > WARMUP_STEPS:
        counters["end"] = graph_counters()
    if args.losses_out:
        write_results(engine, losses, args.losses_out, counters)
    assert all(math.isfinite(x) for x in losses), f"non-finite loss: {losses}"


if __name__ == "__main__":
    main()
