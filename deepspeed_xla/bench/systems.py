"""What the bench runs: the systems, their DeepSpeed configs, and the model's FLOPs."""
import argparse
import json
import re
from dataclasses import dataclass
from typing import Optional

LR, WEIGHT_DECAY = 0.003, 0.01  # scripts/configs/*.json and train.py --client-optimizer
SYSTEM_NAME = re.compile(r"(xla|cpu)-(hf-)?zero([0-3])-([1-9][0-9]*)p$")
DEFAULT_SYSTEMS = ["floor", *(f"xla-zero{stage}-{procs}p" for procs in (1, 2) for stage in range(4)), "cpu-zero0-1p"]


@dataclass(frozen=True)
class System:
    """One row: ``floor``, or DeepSpeed on accelerator ``xla``/``cpu`` at a ZeRO stage on ``procs`` processes;
    ``trainer``: the same model and config trained by the Hugging Face Trainer (``scripts/hf_train.py --model
    tinygpt``) instead of ``scripts/train.py``'s loop."""
    name: str
    accelerator: str
    stage: int = 0
    procs: int = 1
    trainer: bool = False

    @property
    def loop(self) -> str:
        """The ``scripts/train.py`` system a Trainer system is compared with."""
        return self.name.replace("-hf-", "-")


def parse_system(name: str) -> System:
    if name == "floor":
        return System(name, "floor")
    match = SYSTEM_NAME.match(name)
    if not match:
        raise argparse.ArgumentTypeError(f"unknown system {name!r}: name floor or <xla|cpu>-[hf-]zero<0-3>-<N>p, "
                                         "e.g. xla-zero3-2p (ZeRO-3 on 2 XLA processes; hf-: through the Trainer)")
    return System(name, match[1], int(match[3]), int(match[4]), trainer=bool(match[2]))


def matmul_params(dim: int, layers: int, vocab: int) -> int:
    """TinyGPT's parameters without its token and position embeddings (look-ups, which multiply nothing)."""
    block = 12 * dim * dim + 13 * dim  # qkv, proj and the 4x MLP (weights and biases), two LayerNorms
    return layers * block + 2 * dim + dim * vocab + vocab  # the final LayerNorm and the vocabulary head


def flops_per_token(dim: int, layers: int, vocab: int, seq: int) -> int:
    """Training FLOPs per token: 6 N (forward and backward through the N multiplied parameters) plus
    12 L T d (attention scores and weighted values over the full T x T, causal mask not discounted)."""
    return 6 * matmul_params(dim, layers, vocab) + 12 * layers * seq * dim


def ds_config(stage: int, batch: int, zero_options: Optional[dict] = None) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter, as a large model's are
    zero.update(zero_options or {})
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": zero, "steps_per_print": 10 ** 9}


def zero_option(text: str):
    """``KEY=JSON`` of ``--zero``: one zero_optimization setting."""
    key, sep, value = text.partition("=")
    try:
        if key and sep:
            return key, json.loads(value)
    except json.JSONDecodeError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: give KEY=JSON, e.g. contiguous_gradients=true or "
                                     "reduce_bucket_size=5e7")
