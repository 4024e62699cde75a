"""The Hugging Face path on XLA: ``scripts/hf_train.py`` (a transformers ``Trainer`` with a DeepSpeed config of HF
``"auto"`` values, gradient accumulation, clipping, WarmupLR) on 2 processes through ``deepspeed``, ``torchrun`` and
``accelerate launch``, against the same script on DeepSpeed's CPU accelerator.

Each launcher trains its share of the configurations in one job (``tests/train_many.py``): ZeRO 1, 2 and 3 in fp32,
ZeRO 2 and 3 in bf16, PEFT LoRA on ZeRO 2 and 3; every configuration runs once on XLA and once on the CPU
accelerator (one job for all). The ``deepspeed`` job runs with accelerate and transformers seeing a TPU (the
branches every TPU VM takes; ``tests/fixtures/huggingface``). A last job resumes the ZeRO-2 and ZeRO-3 runs from
the Trainer checkpoints they saved. Every run starts from one saved model (``from_pretrained``; under ZeRO-3 it is
built inside ``deepspeed.zero.Init``, whose initialization would draw from each device's own RNG).
"""
import json
import threading
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.conftest import FIXTURES, REPO
from tests.multiproc import PARAM_TOLERANCE, launch_command, run_job, within

HF_TRAIN = REPO / "scripts" / "hf_train.py"
TRAIN_MANY = REPO / "tests" / "train_many.py"
STEPS, SAVED_AT = 6, 3
TRAINER_ARGS = ["--max_steps", STEPS, "--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 2,
                "--max_grad_norm", 1.0, "--learning_rate", 3e-3, "--warmup_steps", 2, "--logging_steps", 1,
                "--report_to", "none", "--save_strategy", "no", "--seed", 7]
# name -> (ZeRO stage, bf16, LoRA, launcher of its XLA run, extra Trainer arguments)
RUNS = {
    "zero1": (1, False, False, "deepspeed", []),
    "zero2": (2, False, False, "deepspeed", ["--save_strategy", "steps", "--save_steps", SAVED_AT]),
    "zero3": (3, False, False, "torchrun", ["--save_strategy", "steps", "--save_steps", SAVED_AT]),
    "zero2-bf16": (2, True, False, "accelerate", ["--logging_steps", 2]),
    "zero3-bf16": (3, True, False, "deepspeed", []),
    "lora-zero2": (2, False, True, "deepspeed", []),
    "lora-zero3": (3, False, True, "deepspeed", []),
}
RESUMED = ("zero2", "zero3")
# Runs whose DeepSpeed config has no scheduler: the Trainer makes its own (linear decay after a warm-up) over
# DeepSpeed's optimizer, as most HF configs do.
TRAINER_SCHEDULED = ("zero1", )
# bf16 losses: the XLA and CPU runs round the same bf16 forward differently, by a few bf16 steps of the loss
# (2^-8 = 3.9e-3 of it each); the bf16 parameters by a bf16 step of a weight and a few Adam steps of lr (multiproc).
LOSS_RTOL = {False: 1e-4 / 3.0, True: 3 * 2 ** -8}


def ds_config(stage: int, scheduler: bool = True) -> dict:
    """The config a user writes for the Trainer: every value HF knows given as ``"auto"``; ``scheduler``: DeepSpeed's
    WarmupLR, else the Trainer's own schedule."""
    config = {key: "auto" for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                      "gradient_clipping", "train_batch_size")}
    config.update({"optimizer": {"type": "AdamW", "params": {key: "auto" for key in ("lr", "betas", "eps",
                                                                                     "weight_decay")}},
                   "scheduler": {"type": "WarmupLR", "params": {key: "auto" for key in (
                       "warmup_min_lr", "warmup_max_lr", "warmup_num_steps")}},
                   "zero_optimization": {"stage": stage}, "bf16": {"enabled": "auto"}})
    if not scheduler:
        del config["scheduler"]
    if stage == 3:
        config["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                           stage3_gather_16bit_weights_on_model_save=True)
    return config


def _accelerate_config(path: Path, ds_config_path: Path) -> Path:
    """``accelerate config``'s answer for DeepSpeed on one machine: the DeepSpeed config file (its ``"auto"``
    precision follows the Trainer's ``--bf16``), 2 processes."""
    path.write_text("\n".join([
        "compute_environment: LOCAL_MACHINE", "distributed_type: DEEPSPEED", "deepspeed_config:",
        f"  deepspeed_config_file: {ds_config_path}", "  zero3_init_flag: true", "num_machines: 1", "machine_rank: 0",
        "num_processes: 2", "use_cpu: false", ""]))
    return path


class HfRuns:
    """Every run of this module, launched once (per side, per launcher) the first time a test asks."""

    def __init__(self, root: Path):
        self.root = root
        self.model_dir = root / "model"
        self.results: Dict[str, dict] = {}
        self.record = root / "fake-tpu-env.jsonl"
        self._lock = threading.Lock()

    def _args(self, name: str, accelerator: str, resume: bool = False) -> List[str]:
        stage, bf16, lora, launcher, extra = RUNS[name]
        workdir = self.root / name / accelerator
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / "ds_config.json"
        config_path.write_text(json.dumps(ds_config(stage, scheduler=name not in TRAINER_SCHEDULED)))
        label = f"{name}-resumed" if resume else name
        args = [*TRAINER_ARGS, *extra, "--output_dir", workdir / "out", "--model_dir", self.model_dir,
                "--results_out", workdir / f"{label}.json"]
        if not (accelerator == "xla" and launcher == "accelerate"):  # there the DeepSpeed config comes from accelerate
            args += ["--deepspeed", config_path]
        if bf16:
            args += ["--bf16", "true"]
        if lora:
            args += ["--lora", "true"]
        if resume:
            args += ["--resume_from_checkpoint", workdir / "out" / f"checkpoint-{SAVED_AT}"]
        return list(map(str, args))

    def _job(self, jobdir: Path, runs: List[List[str]], accelerator: str, launcher: str, extra_env: dict,
             launcher_args=()) -> None:
        jobdir.mkdir(parents=True, exist_ok=True)
        plan_file = jobdir / "runs.json"
        plan_file.write_text(json.dumps([{"args": args} for args in runs]))
        cmd, env = launch_command([TRAIN_MANY, "--script", HF_TRAIN, "--runs", plan_file], accelerator, 2,
                                  extra_env, launcher, launcher_args)
        run_job(cmd, env, jobdir, timeout=300 + 150 * len(runs))

    def _cpu_job(self) -> None:
        self._job(self.root / "cpu-job", [self._args(name, "cpu") for name in RUNS], "cpu", "deepspeed",
                  {"USE_TORCH_XLA": "0", "PYTHONPATH": FIXTURES / "huggingface", "DSX_TEST_HF_CPU_REFERENCE": "1"})

    def _xla_job(self, launcher: str) -> None:
        names = [name for name, run in RUNS.items() if run[3] == launcher]
        extra_env, launcher_args = {}, ()
        if launcher == "deepspeed":
            extra_env = {"PYTHONPATH": FIXTURES / "huggingface", "DSX_TEST_HF_FAKE_TPU": "1",
                         "DSX_TEST_HF_RECORD": self.record}
        if launcher == "accelerate":
            name, = names
            workdir = self.root / name / "xla"
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / "ds_config.json").write_text(json.dumps(ds_config(RUNS[name][0])))
            config_file = _accelerate_config(workdir / "accelerate.yaml", workdir / "ds_config.json")
            launcher_args = ("--config_file", config_file)
        self._job(self.root / f"xla-{launcher}-job", [self._args(name, "xla") for name in names], "xla", launcher,
                  extra_env, launcher_args)

    def _save_model(self) -> None:
        """The model every run starts from, written by ``hf_train.build_model`` on the host."""
        from deepspeed_xla.bench.example import load_example
        from transformers import set_seed
        hf_train = load_example(str(HF_TRAIN))
        set_seed(0)
        hf_train.build_model(hf_train.ExampleArguments()).save_pretrained(self.model_dir)

    def run_all(self) -> None:
        with self._lock:
            if self.results:
                return
            self._save_model()
            errors = []

            def guarded(job, *args):
                try:
                    job(*args)
                except BaseException as error:  # every test of the module fails with the job's error
                    errors.append(error)

            cpu = threading.Thread(target=guarded, args=(self._cpu_job, ))
            cpu.start()
            for launcher in ("deepspeed", "torchrun", "accelerate"):
                guarded(self._xla_job, launcher)
            if not errors:
                guarded(self._job, self.root / "resume-job", [self._args(name, "xla", resume=True) for name in RESUMED],
                        "xla", "deepspeed", {})
            cpu.join()
            if errors:
                raise errors[0]
            for name in RUNS:
                for accelerator in ("xla", "cpu"):
                    self.results[f"{name}/{accelerator}"] = self._read(self.root / name / accelerator / f"{name}.json")
            for name in RESUMED:
                self.results[f"{name}/resumed"] = self._read(self.root / name / "xla" / f"{name}-resumed.json")

    @staticmethod
    def _read(out: Path) -> dict:
        result = json.loads(out.read_text())
        result["other_ranks"] = [json.loads(Path(f"{out}.rank1").read_text())]
        return result


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory) -> HfRuns:
    runs = HfRuns(tmp_path_factory.mktemp("huggingface"))
    runs.run_all()
    return runs


def assert_trains_like(xla: dict, cpu: dict, bf16: bool) -> None:
    """Rank 0's logged losses (the mean over ranks, at each logging step) within ``LOSS_RTOL`` of the CPU
    accelerator's, and every rank's trainable weights within the parity tests' tolerance, in the right dtype."""
    assert (xla["accelerator"], cpu["accelerator"]) == ("xla", "cpu")
    assert xla["world_size"] == cpu["world_size"] == 2
    assert [step for step, _ in xla["logged_losses"]] == [step for step, _ in cpu["logged_losses"]] != []
    assert within([loss for _, loss in xla["logged_losses"]], [loss for _, loss in cpu["logged_losses"]], atol=0,
                  rtol=LOSS_RTOL[bf16]), (xla["logged_losses"], cpu["logged_losses"])
    dtype = "bfloat16" if bf16 else "float32"
    for mine, theirs in zip([xla, *xla["other_ranks"]], [cpu, *cpu["other_ranks"]], strict=True):
        assert mine["params"].keys() == theirs["params"].keys() != set()
        assert set(mine["param_dtypes"].values()) == set(theirs["param_dtypes"].values()) == {dtype}
        for name, values in mine["params"].items():
            values, expected = torch.tensor(values, dtype=torch.float64), torch.tensor(theirs["params"][name],
                                                                                        dtype=torch.float64)
            assert values.shape == expected.shape, name
            # GPT-2's key biases (the middle third of c_attn.bias) get round-off gradients that Adam scales to steps
            atol = torch.full_like(expected, PARAM_TOLERANCE[dtype]["atol"])
            if name.endswith("c_attn.bias"):
                third = len(expected) // 3
                atol[third:2 * third] = 2 * 3e-3 * STEPS + 1e-3
            differs = (values - expected).abs() > atol + PARAM_TOLERANCE[dtype]["rtol"] * expected.abs()
            assert not differs.any(), f"{name} differs at {differs.nonzero().flatten().tolist()[:5]}"


@pytest.mark.parametrize("name", RUNS)
def test_trainer_matches_cpu_accelerator(hf_runs, name):
    """Each configuration's Trainer run on XLA (its launcher: ``RUNS``) trains like the CPU accelerator's, through a
    DeepSpeed engine of the config's ZeRO stage; LoRA trains only the adapter."""
    stage, bf16, lora = RUNS[name][:3]
    xla, cpu = hf_runs.results[f"{name}/xla"], hf_runs.results[f"{name}/cpu"]
    assert_trains_like(xla, cpu, bf16)
    for result in (xla, cpu):
        assert (result["engine"], result["zero_stage"]) == ("DeepSpeedEngine", stage)
        assert all(("lora_" in param) == lora for param in result["params"]), sorted(result["params"])
        assert result["built_partitioned"] == (stage == 3)


def test_tpu_vms_train_through_deepspeed_without_xla_bf16_variables(hf_runs):
    """The ``deepspeed`` job's runs see a TPU as accelerate and transformers check for one: they still train through
    DeepSpeed (above), and no process of the job (the runner, its launcher, the workers) ever set XLA_USE_BF16 or
    XLA_DOWNCAST_BF16 (accelerate's TPU bf16)."""
    records = [json.loads(line) for line in hf_runs.record.read_text().splitlines()]
    assert sorted(record["rank"] for record in records if record["rank"] is not None) == ["0", "1"]
    assert all(record["XLA_USE_BF16"] is None and record["XLA_DOWNCAST_BF16"] is None for record in records)


@pytest.mark.parametrize("name", RESUMED)
def test_resume_from_trainer_checkpoint_continues_exactly(hf_runs, name):
    """``resume_from_checkpoint`` of the Trainer checkpoint saved at step 3, in a new job: steps 4-6 log the
    uninterrupted run's losses and end with its weights."""
    whole, resumed = hf_runs.results[f"{name}/xla"], hf_runs.results[f"{name}/resumed"]
    after = [entry for entry in whole["logged_losses"] if entry[0] > SAVED_AT]
    assert [step for step, _ in resumed["logged_losses"]] == [step for step, _ in after] == [4, 5, 6]
    assert within([loss for _, loss in resumed["logged_losses"]], [loss for _, loss in after], atol=1e-6, rtol=0)
    for mine, theirs in zip([resumed, *resumed["other_ranks"]], [whole, *whole["other_ranks"]]):
        assert mine["params"].keys() == theirs["params"].keys()
        for param, values in mine["params"].items():
            assert within(values, theirs["params"][param], atol=1e-6, rtol=0), param


def test_lora_adapter_saved_loads(hf_runs):
    """The LoRA runs save their adapter with ``save_pretrained``: it loads onto the base model with PEFT, and its
    weights are the trained ones (gathered under ZeRO-3)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    for name in ("lora-zero2", "lora-zero3"):
        trained = hf_runs.results[f"{name}/xla"]["params"]
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_runs.model_dir),
                                          hf_runs.root / name / "xla" / "out" / "adapter")
        loaded = {param: p for param, p in model.named_parameters() if "lora_" in param}
        assert loaded.keys() == trained.keys()
        for param, p in loaded.items():
            assert within(p.detach().tolist(), trained[param], atol=1e-6, rtol=0), param


def test_trainer_steps_read_the_device_only_to_log(hf_runs):
    """After warm-up a Trainer step compiles nothing and reads nothing back from the device; a logging step reads
    what it logs (the loss gathered over ranks, the gradient norm). The accelerate run logs every second step: the
    counters after step s cover step s and the logging of step s-1."""
    counters = dict((step, figures) for step, figures in hf_runs.results["zero2-bf16/xla"]["step_counters"])
    steps = {step: {key: counters[step][key] - counters[step - 1][key] for key in counters[step]}
             for step in range(4, STEPS + 1)}
    assert all(figures["compilations"] == 0 for figures in steps.values()), steps
    assert steps[4]["transfers_to_host"] == steps[6]["transfers_to_host"] == 0, steps
    assert steps[5]["transfers_to_host"] > 0, steps
    assert steps[4]["executions"] == steps[6]["executions"], steps
