"""Benchmark: a GPT-style decoder trained by a hand-written torch_xla loop (the floor), by DeepSpeed through
deepspeed_xla (ZeRO 0-3 on 1 and on 2 processes, optionally with one DeepSpeed feature: MoE, Ulysses, AutoTP, hpZ,
activation checkpointing, ZeRO-Offload or engine.compile()) and by DeepSpeed's own CPU accelerator, in one table.

    PJRT_DEVICE=CPU python -m deepspeed_xla.bench                            # every system, the default small GPT
    python -m deepspeed_xla.bench --steps 20 --out bench.json --png bench.png
    python -m deepspeed_xla.bench --systems floor xla-zero2-1p xla-zero3-2p --skip-bandwidth
    python -m deepspeed_xla.bench --systems xla-zero1-2p xla-zero1-2p-moe cpu-zero1-2p-moe --skip-bandwidth
    PJRT_DEVICE=TPU python -m deepspeed_xla.bench --dim 1024 --layers 8 --seq 1024 --batch 8   # adds MFU

Run it from a deepspeed-xla checkout: a DeepSpeed system is ``deepspeed --num_gpus N scripts/train.py --timings``
(the example, launched as users launch it), and the floor trains the same TinyGPT on the same batches with
torch.optim.AdamW of the same hyper-parameters, one ``torch_xla.sync()`` per step. Every system runs in processes
of its own, one system after another, so that no process holds the device while another needs it. The bench also
times a 64 MB all-reduce between 2 processes on the device's comm path against gloo on CPU tensors, and compares
ZeRO-3's device bytes per rank on 2 processes with 1. docs/performance.md explains the columns and the FLOPs
formula, and records a run.
"""
