"""The bench's own workers, each run in a process of its own: the floor loop and the all-reduce timing."""
import argparse
import json
import resource
import time
from pathlib import Path
from typing import Callable, Dict

from deepspeed_xla.bench.example import load_example
from deepspeed_xla.bench.systems import LR, WEIGHT_DECAY


def floor_worker(args: argparse.Namespace) -> None:
    """System (a): train.py's model, rank-0 batches and seed, torch.optim.AdamW, one graph cut per step; the
    gradients of ``--grad-accum`` micro-batches summed as DeepSpeed sums them (each loss over their count), clipped
    to ``--clip`` when given; the result has the fields of train.py's ``--losses-out`` JSON."""
    train = load_example(args.train_script)
    import torch
    from deepspeed_xla import xla_runtime
    from deepspeed_xla.bench.clock import StepClock
    xla_runtime.torch_xla()
    device = xla_runtime.device()
    torch.manual_seed(args.seed)
    model = train.TinyGPT(args.vocab, args.dim, args.layers, seq=args.seq).to(device)
    # foreach: the multi-tensor form that deepspeed_xla's FusedAdam uses too
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    losses, counters, clock = [], {}, StepClock(xla_runtime.execution_clock)
    for step in range(args.steps):
        if step == args.warmup:
            counters["warm"] = xla_runtime.graph_counters()
        clock.start()
        micro_losses = []
        for micro_step in range(args.grad_accum):
            tokens, targets = train.make_batch(step * args.grad_accum + micro_step, 0, args.batch, args.seq,
                                               args.vocab)
            loss = model(tokens.to(device), targets.to(device))
            (loss / args.grad_accum).backward()
            micro_losses.append(loss.detach())
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # torch_xla's own, no foreach
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(micro_losses)
        xla_runtime.sync(wait=False)
        xla_runtime.wait_device()
        clock.end()
    counters["end"] = xla_runtime.graph_counters()
    state = [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {"world_size": 1, "rank": 0, "counters": counters, **clock.results(),
              "device_bytes": xla_runtime.live_device_bytes(), "peak_rss_bytes": usage.ru_maxrss * 1024,  # KiB
              "cpu_s": usage.ru_utime + usage.ru_stime, "state_bytes": sum(t.numel() * t.element_size() for t in state),
              "losses": [sum(float(loss) for loss in micro) / len(micro) for micro in losses]}
    Path(args.worker_out).write_text(json.dumps(result))


def bandwidth_worker(args: argparse.Namespace) -> None:
    """One rank of the all-reduce comparison (under ``deepspeed --num_gpus 2``): a device tensor through DeepSpeed's
    backend for this device type (PJRT CPU: the host-staged ``xla_host``) against gloo on a CPU tensor."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed()
    accelerator = get_accelerator()
    gloo = dist.new_group(backend="gloo")
    numel = args.bandwidth_mb * 2 ** 20 // 4
    on_device, on_host = torch.ones(numel, device=accelerator.current_device_name()), torch.ones(numel)

    def timed(tensor: torch.Tensor, group=None) -> float:
        dist.barrier(group=gloo)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if tensor is on_device:
            accelerator.synchronize()
        return time.perf_counter() - start

    # The first round connects the ranks and compiles the transfers; sums of ones stay exact in float32.
    rounds = [(timed(on_device), timed(on_host, gloo)) for _ in range(args.bandwidth_iters + 1)][1:]
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps({
            "bytes": numel * 4, "backend": dist.get_backend(), "device_seconds": [r[0] for r in rounds],
            "gloo_seconds": [r[1] for r in rounds]}))


WORKERS: Dict[str, Callable[[argparse.Namespace], None]] = {"floor": floor_worker, "bandwidth": bandwidth_worker}
