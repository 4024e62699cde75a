"""Fine-tune a small GPT-2 with the Hugging Face Trainer and a DeepSpeed config; runs unchanged on XLA or CPU.

    DS_ACCELERATOR=xla deepspeed --num_gpus 2 scripts/hf_train.py --deepspeed scripts/configs/hf_zero2.json
    DS_ACCELERATOR=xla torchrun --nproc_per_node 2 scripts/hf_train.py --deepspeed scripts/configs/hf_zero2.json
    DS_ACCELERATOR=xla accelerate launch --config_file scripts/configs/accelerate_zero2.yaml scripts/hf_train.py

Every ``TrainingArguments`` flag works (``--bf16``, ``--gradient_accumulation_steps``, ``--save_steps``,
``--resume_from_checkpoint`` ...); the DeepSpeed config's ``"auto"`` values are filled from them. The model is
built from a ``GPT2Config`` and the data is generated (seeded random token sequences), so nothing is downloaded.
``--lora`` trains a PEFT LoRA adapter on the frozen model instead (saved to ``<output_dir>/adapter``).
``--results_out`` writes the logged losses, the trained weights and the XLA graph counters per step as JSON (rank
r>0 at ``<path>.rank<r>``), which is what the tests compare across accelerators. ``--model tinygpt --timings true``
is how ``python -m deepspeed_xla.bench`` runs it (system ``xla-hf-zero2-2p``): ``scripts/train.py``'s model, each step
waited for, and train.py's timing fields in the JSON.
"""
import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, HfArgumentParser, Trainer, TrainerCallback,
                          TrainingArguments, set_seed)


@dataclasses.dataclass
class ExampleArguments:
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    seq: int = 16
    samples: int = 256
    model_dir: Optional[str] = dataclasses.field(default=None, metadata={"help": "load the model saved here"})
    model: str = dataclasses.field(default="gpt2", metadata={"choices": ["gpt2", "tinygpt"],
                                                             "help": "GPT-2, or scripts/train.py's TinyGPT"})
    lora: bool = dataclasses.field(default=False, metadata={"help": "train a LoRA adapter (PEFT) on the frozen model"})
    timings: bool = dataclasses.field(default=False, metadata={"help": "wait for the device after every step"})
    bench_warmup: int = dataclasses.field(default=3, metadata={"help": "steps before the graph counters start"})
    results_out: Optional[str] = dataclasses.field(default=None, metadata={"help": "write losses and weights here"})


class TokenSequences(torch.utils.data.Dataset):
    """``samples`` random token sequences, the same on every rank and accelerator (the sampler splits them)."""

    def __init__(self, samples: int, seq: int, vocab: int, seed: int):
        self.tokens = torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        tokens = self.tokens[index]  # with the attention mask a tokenizer gives
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens}


@functools.lru_cache(maxsize=None)
def train_script():
    """``scripts/train.py`` as a module: its TinyGPT, graph counters and timing measurements."""
    from deepspeed_xla.bench.example import load_example
    return load_example(str(Path(__file__).with_name("train.py")))


class TinyGPTForTrainer(torch.nn.Module):
    """``scripts/train.py``'s model with the Trainer's batch names: predicts each next token, returns ``{"loss"}``."""

    def __init__(self, example: ExampleArguments):
        super().__init__()
        self.model = train_script().TinyGPT(example.vocab, example.dim, example.layers, seq=example.seq)

    def forward(self, input_ids, labels, attention_mask=None):
        return {"loss": self.model(input_ids, labels.roll(-1, dims=1))}


def build_model(example: ExampleArguments) -> torch.nn.Module:
    """GPT-2 from ``--model_dir`` or from a config, without dropout: runs on different accelerators would draw
    different dropout masks. Built the way HF builds models: under ZeRO-3, partitioned as it is built. Eager
    attention: with SDPA, transformers reads the attention mask on the host in every forward (docs/huggingface.md)."""
    if example.model == "tinygpt":
        return TinyGPTForTrainer(example)
    if example.model_dir:
        model = AutoModelForCausalLM.from_pretrained(example.model_dir, attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_config(GPT2Config(
            vocab_size=example.vocab, n_positions=example.seq, n_embd=example.dim, n_layer=example.layers, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), attn_implementation="eager")
    if example.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                                 lora_dropout=0.0))
    return model


class Results(TrainerCallback):
    """Collects what ``--results_out`` writes: each logged loss with its step, XLA graph counters after each step
    (and after ``warmup`` and after the last step, as train.py reads them); with ``timings``, each step's time, the
    device waited for at its end."""

    def __init__(self, warmup: int, timings: bool):
        self.warmup, self.timings = warmup, timings
        self.losses, self.step_counters, self.counters, self.step_times = [], [], {}, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append([state.global_step, logs["loss"]])

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        train = train_script()
        if self.timings:
            train.wait_for_device()
            self.step_times.append(time.perf_counter() - self.step_start)
        counters = train.graph_counters()
        if counters:
            self.step_counters.append([state.global_step, counters])
        if state.global_step == self.warmup:
            self.counters["warm"] = counters
        if state.global_step == state.max_steps:  # before the last step's logging and the end of training
            self.counters["end"] = counters


def library_versions() -> dict:
    """The releases this run imported (the tests run the oldest supported ones from another folder)."""
    import accelerate
    import transformers
    return {"transformers": transformers.__version__, "accelerate": accelerate.__version__}


def write_results(trainer: Trainer, results: Results, path: str, built_partitioned: bool) -> None:
    """Every rank's trained weights (gathered under ZeRO-3) with their dtypes, rank 0's logged losses."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    engine = trainer.model_wrapped
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        weights, dtypes = train_script().host_weights(
            (name, p) for name, p in engine.module.named_parameters() if p.requires_grad)
    rank = trainer.args.process_index
    measured = train_script().measurements(engine, results.step_times) if results.timings else {}
    with open(path if rank == 0 else f"{path}.rank{rank}", "w") as handle:
        json.dump({"logged_losses": results.losses, "losses": [loss for _, loss in results.losses],
                   "step_counters": results.step_counters, "counters": results.counters, "rank": rank,
                   **measured,
                   "world_size": trainer.args.world_size, "accelerator": get_accelerator().device_name(),
                   "engine": type(engine).__name__, "zero_stage": engine.zero_optimization_stage(),
                   "built_partitioned": built_partitioned, "versions": library_versions(),
                   "device": str(trainer.args.device), "backend": torch.distributed.get_backend(),
                   "params": weights, "param_dtypes": dtypes}, handle)


def main(argv=None) -> None:
    parser = HfArgumentParser((TrainingArguments, ExampleArguments))
    args, example = parser.parse_args_into_dataclasses(argv)
    set_seed(args.seed)
    model = build_model(example)  # after TrainingArguments: under ZeRO-3 the model is built partitioned
    built_partitioned = all(hasattr(param, "ds_id") for name, param in model.named_parameters() if "lora_" not in name)
    results = Results(example.bench_warmup, example.timings)
    # Only for --results_out: reading the graph counters after each step waits for the device.
    trainer = Trainer(model=model, args=args, callbacks=[results] if example.results_out else [],
                      train_dataset=TokenSequences(example.samples, example.seq, example.vocab, args.seed))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if example.results_out:
        write_results(trainer, results, example.results_out, built_partitioned)
    if args.process_index == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"trained {trainer.state.global_step} steps on {args.device}: last loss "
              f"{losses[-1] if losses else float('nan'):.4f}; model {type(trainer.model_wrapped)}", flush=True)
    if example.lora:  # every rank: under ZeRO-3 the adapter's weights are gathered from all of them
        trainer.save_model(os.path.join(args.output_dir, "adapter"))


if __name__ == "__main__":
    main()
