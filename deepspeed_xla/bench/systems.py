"""What the bench runs: the systems, their DeepSpeed configs, and the model's FLOPs."""
import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

LR, WEIGHT_DECAY = 0.003, 0.01  # scripts/configs/*.json and train.py --client-optimizer
DEFAULT_SYSTEMS = ["floor", *(f"xla-zero{stage}-{procs}p" for procs in (1, 2) for stage in range(4)), "cpu-zero0-1p"]
# AutoTP shards the layers it recognises by name (Llama's q_proj, o_proj, ...) or by a Hugging Face model's tp_plan;
# TinyGPT has neither, and its fused qkv must be split as three matrices, which a tp_plan cannot say. So the config
# names its layers in DeepSpeed's partition_config: column-parallel in, row-parallel out of attention and MLP.
TINYGPT_TP_LAYERS = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.qkv\.weight$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0},
    {"patterns": [r".*\.mlp\.0\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.proj\.weight$", r".*\.mlp\.2\.weight$"], "partition_type": "row"}]}


@dataclass(frozen=True)
class Feature:
    """A DeepSpeed feature a system trains with (a suffix of its name): ``scripts/train.py``'s flags and the config
    sections that turn it on; ``outputs`` name the (section, key) of each file or folder it writes, which the bench
    points into its work folder; ``width`` ranks share one batch (tensor and sequence parallelism), and the processes
    must be a multiple of ``group``."""
    what: str
    flags: Tuple[str, ...] = ()
    config: dict = field(default_factory=dict)
    outputs: Tuple[Tuple[str, str], ...] = ()
    zero: dict = field(default_factory=dict)
    stages: Tuple[int, ...] = (0, 1, 2, 3)
    width: int = 1
    group: int = 1


# TinyGPT's 2 attention heads bound tensor and sequence parallelism to 2 ranks.
FEATURES = {
    "moe": Feature("each MLP as 2 DeepSpeed MoE experts, top-1 gating, expert parallelism up to 2",
                   ("--moe-experts", "2")),
    "sp": Feature("Ulysses sequence parallelism over 2 ranks", ("--sequence-parallel", "2"), width=2, group=2),
    "tp": Feature("AutoTP tensor parallelism over 2 ranks", config={"tensor_parallel": {
        "autotp_size": 2, "partition_config": TINYGPT_TP_LAYERS}}, width=2, group=2),
    "hpz": Feature("ZeRO++ hierarchical partitioning over 2 ranks", zero={"zero_hpz_partition_size": 2}, stages=(3,),
                   group=2),
    "ckpt": Feature("each block's activations recomputed in backward (deepspeed.checkpointing)",
                    ("--activation-checkpointing",)),
    "offload": Feature("ZeRO-Offload, the optimizer on the host", zero={"offload_optimizer": {"device": "cpu"}},
                       stages=(1, 2, 3)),
    "compile": Feature("engine.compile() with the accelerator's torch.compile backend", ("--compile",)),
    "zinit": Feature("the model built inside deepspeed.zero.Init, partitioned as it is made", ("--zero-init",),
                     stages=(3,)),
    "monitors": Feature("the CSV and TensorBoard monitors, written every step", config={
        "csv_monitor": {"enabled": True, "job_name": "bench"}, "tensorboard": {"enabled": True, "job_name": "bench"}},
        outputs=(("csv_monitor", "output_path"), ("tensorboard", "output_path"))),
    # DeepSpeed counts profile_step from 1: the second step, inside the warm-up, whose timings the bench leaves out.
    "profiler": Feature("the flops profiler on the second step (inside the warm-up)", config={
        "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False}},
        outputs=(("flops_profiler", "output_file"),)),
    "comms": Feature("DeepSpeed's comms logger timing every collective", config={
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False}}),
}
SYSTEM_NAME = re.compile(rf"(xla|cpu)-(hf-)?zero([0-3])-([1-9][0-9]*)p(?:-({'|'.join(FEATURES)}))?$")
NAMING = "floor or <xla|cpu>-[hf-]zero<0-3>-<N>p[-<feature>]"


def feature_list() -> str:
    """The features and what each runs, for the help and the errors."""
    return "; ".join(f"{name}: {feature.what}" for name, feature in FEATURES.items())


@dataclass(frozen=True)
class System:
    """One row: ``floor``, or DeepSpeed on accelerator ``xla``/``cpu`` at a ZeRO stage on ``procs`` processes,
    optionally with one of ``FEATURES``; ``trainer``: the same model and config trained by the Hugging Face Trainer
    (``scripts/hf_train.py --model tinygpt``) instead of ``scripts/train.py``'s loop."""
    name: str
    accelerator: str
    stage: int = 0
    procs: int = 1
    trainer: bool = False
    feature: Optional[str] = None

    @property
    def loop(self) -> str:
        """The ``scripts/train.py`` system a Trainer system is compared with."""
        return self.name.replace("-hf-", "-")

    @property
    def data_parallel(self) -> int:
        """How many batches a step trains on: one per group of ranks that share one."""
        return self.procs // FEATURES[self.feature].width if self.feature else self.procs


def parse_system(name: str) -> System:
    if name == "floor":
        return System(name, "floor")
    match = SYSTEM_NAME.match(name)
    if not match:
        raise argparse.ArgumentTypeError(
            f"unknown system {name!r}: name {NAMING}, e.g. xla-zero3-2p (ZeRO-3 on 2 XLA processes; hf-: through the "
            f"Trainer) or xla-zero1-2p-moe. Features: {feature_list()}")
    system = System(name, match[1], int(match[3]), int(match[4]), trainer=bool(match[2]), feature=match[5])
    feature = FEATURES.get(system.feature)
    if feature:
        for wrong, needs in ((system.trainer, "scripts/train.py, not the Trainer (hf-)"),
                             (system.stage not in feature.stages, f"ZeRO stage {'/'.join(map(str, feature.stages))}"),
                             (system.procs % feature.group, f"a multiple of {feature.group} processes")):
            if wrong:
                raise argparse.ArgumentTypeError(f"{name}: {system.feature} needs {needs}")
    return system


def matmul_params(dim: int, layers: int, vocab: int) -> int:
    """TinyGPT's parameters without its token and position embeddings (look-ups, which multiply nothing)."""
    block = 12 * dim * dim + 13 * dim  # qkv, proj and the 4x MLP (weights and biases), two LayerNorms
    return layers * block + 2 * dim + dim * vocab + vocab  # the final LayerNorm and the vocabulary head


def flops_per_token(dim: int, layers: int, vocab: int, seq: int) -> int:
    """Training FLOPs per token: 6 N (forward and backward through the N multiplied parameters) plus
    12 L T d (attention scores and weighted values over the full T x T, causal mask not discounted)."""
    return 6 * matmul_params(dim, layers, vocab) + 12 * layers * seq * dim


def ds_config(stage: int, batch: int, zero_options: Optional[dict] = None, feature: Optional[str] = None,
              outputs: Path = Path("."), accum: int = 1, clip: float = 0.0) -> dict:
    """A system's DeepSpeed config; ``feature`` adds its sections, writing under ``outputs``; ``zero_options``
    (``--zero``) come last; ``accum`` micro-batches a step, gradients clipped to the global norm ``clip``, 0 for none:
    always written, as DeepSpeed's own default clips to 1.0, which the floor would not do."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # partition every parameter, as a large model's are
    extra = FEATURES[feature] if feature else Feature("")
    zero.update(extra.zero)
    zero.update(zero_options or {})
    sections = {name: dict(section) for name, section in extra.config.items()}
    for name, key in extra.outputs:
        sections[name][key] = str(outputs / name)
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": accum, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": zero, "steps_per_print": 10 ** 9, **sections}


def train_flags(system: System) -> List[str]:
    """The ``scripts/train.py`` flags of ``system``'s feature."""
    return list(FEATURES[system.feature].flags) if system.feature else []


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
