"""The Hugging Face path on XLA: ``scripts/hf_train.py`` (a transformers ``Trainer`` with a DeepSpeed config of HF
``"auto"`` values, gradient accumulation, clipping, WarmupLR) on 2 processes through ``deepspeed``, ``torchrun`` and
``accelerate launch``, against the same script on DeepSpeed's CPU accelerator.

Every configuration (ZeRO 1, 2 and 3 in fp32, ZeRO 2 and 3 in bf16) trains through every launcher, PEFT LoRA on
ZeRO 2 and 3 through ``deepspeed``; each launcher's runs share one job (``tests/train_many.py``), and every
configuration runs once on the CPU accelerator (one job for all, its ranks forked from a fork server: the launcher
only decides the process environment, the training is the same). The ``deepspeed`` and ``accelerate`` jobs run with
accelerate and transformers seeing a TPU (the branches every TPU VM takes; ``tests/fixtures/huggingface``). The
``torchrun`` job ends by resuming the ZeRO-2 and ZeRO-3 runs of the ``deepspeed`` job from the Trainer checkpoints
they saved. The jobs run at once but for the ``torchrun`` one, which starts when the ``deepspeed`` job has saved its
checkpoints. Every run starts from one saved model (``from_pretrained``; under ZeRO-3 it is built inside
``deepspeed.zero.Init``, whose initialization would draw from each device's own RNG).
"""
import functools
import json
import threading
from pathlib import Path
from typing import Dict, List

import pytest

from tests.conftest import FIXTURES, REPO
from tests.multiproc import assert_weights_like, launch_command, run_forked_job, run_job, within

HF_TRAIN = REPO / "scripts" / "hf_train.py"
TRAIN_MANY = REPO / "tests" / "train_many.py"
STEPS, SAVED_AT = 6, 3
TRAINER_ARGS = ["--max_steps", STEPS, "--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 2,
                "--max_grad_norm", 1.0, "--learning_rate", 3e-3, "--warmup_steps", 2, "--logging_steps", 1,
                "--report_to", "none", "--save_strategy", "no", "--seed", 7]
LAUNCHERS = ("deepspeed", "torchrun", "accelerate")
# name -> (ZeRO stage, bf16, LoRA, extra Trainer arguments). zero2-bf16 logs every second step: the graph test
# tells logging steps from the others there.
CONFIGS = {
    "zero1": (1, False, False, []),
    "zero2": (2, False, False, []),
    "zero3": (3, False, False, []),
    "zero2-bf16": (2, True, False, ["--logging_steps", 2]),
    "zero3-bf16": (3, True, False, []),
    "lora-zero2": (2, False, True, []),
    "lora-zero3": (3, False, True, []),
}
# The XLA runs, as (configuration, launcher): every configuration through every launcher, LoRA through deepspeed.
XLA_RUNS = [(name, launcher) for name, (_, _, lora, _) in CONFIGS.items() for launcher in LAUNCHERS
            if launcher == "deepspeed" or not lora]
# The deepspeed job's runs that save a Trainer checkpoint at SAVED_AT; the torchrun job resumes them.
RESUMED = ("zero2", "zero3")
# Runs whose DeepSpeed config has no scheduler: the Trainer makes its own (linear decay after a warm-up) over
# DeepSpeed's optimizer, as most HF configs do.
TRAINER_SCHEDULED = ("zero1", )
# bf16 losses: the XLA and CPU runs round the same bf16 forward differently, by a few bf16 steps of the loss
# (2^-8 = 3.9e-3 of it each); the bf16 parameters by a bf16 step of a weight and a few Adam steps of lr (multiproc).
LOSS_RTOL = {False: 1e-4 / 3.0, True: 3 * 2 ** -8}
# GPT-2's key biases (the middle third of c_attn.bias) get round-off gradients that Adam scales to steps of lr.
KEY_BIAS = ("c_attn.bias", 2 * 3e-3 * STEPS + 1e-3)
# The saved model: hf_train.py's GPT-2 with one block instead of two, every kind of parameter the runs train (a
# ZeRO-3 run compiled 73 graphs in 3.2 s per rank instead of 85 in 4.5 s).
MODEL = {"layers": 1}


def save_model(model_dir: Path) -> None:
    """The model every run starts from (``MODEL``), written by ``hf_train.build_model`` on the host."""
    from deepspeed_xla.bench.example import load_example
    from transformers import set_seed
    hf_train = load_example(str(HF_TRAIN))
    set_seed(0)
    hf_train.build_model(hf_train.ExampleArguments(**MODEL)).save_pretrained(model_dir)


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
    """Every run of this module, launched once (one job per launcher, one for the CPU accelerator) the first time a
    test asks. A run's files go to ``<root>/<configuration>/<side>``, side ``cpu`` or the XLA run's launcher."""

    def __init__(self, root: Path):
        self.root = root
        self.model_dir = root / "model"
        self.results: Dict[str, dict] = {}
        self.record = root / "fake-tpu-env.jsonl"
        self._lock = threading.Lock()

    def _run(self, name: str, side: str, resume: bool = False) -> dict:
        """One entry of a ``train_many`` plan; ``resume``: the deepspeed run of ``name`` again, from its checkpoint."""
        stage, bf16, lora, extra = CONFIGS[name]
        workdir = self.root / name / side
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / "ds_config.json"
        config_path.write_text(json.dumps(ds_config(stage, scheduler=name not in TRAINER_SCHEDULED)))
        label = f"{name}-resumed" if resume else name
        args = [*TRAINER_ARGS, *extra, "--model_dir", self.model_dir, "--results_out", workdir / f"{label}.json",
                "--output_dir", workdir / "out"]
        if name in RESUMED and side == "deepspeed":
            args += ["--save_strategy", "steps", "--save_steps", SAVED_AT]
        if resume:
            args += ["--resume_from_checkpoint", self.root / name / "deepspeed" / "out" / f"checkpoint-{SAVED_AT}"]
        if bf16:
            args += ["--bf16", "true"]
        if lora:
            args += ["--lora", "true"]
        if side != "accelerate":  # there the DeepSpeed config comes from accelerate (the run's env)
            return {"args": list(map(str, [*args, "--deepspeed", config_path]))}
        return {"args": list(map(str, args)), "env": {"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config_path)}}

    def _job(self, side: str, runs: List[dict], extra_env: dict, launcher: str, launcher_args=()) -> None:
        jobdir = self.root / f"{side}-job"
        jobdir.mkdir(parents=True, exist_ok=True)
        plan_file = jobdir / "runs.json"
        plan_file.write_text(json.dumps(runs))
        args, timeout = ["--script", HF_TRAIN, "--runs", plan_file], 300 + 150 * len(runs)
        if launcher == "fork":
            run_forked_job("tests.train_many:main", "cpu", 2, extra_env, timeout, args=args)
            return
        cmd, env = launch_command([TRAIN_MANY, *args], "xla", 2, extra_env, launcher, launcher_args)
        run_job(cmd, env, jobdir, timeout)

    def _cpu_job(self) -> None:
        self._job("cpu", [self._run(name, "cpu") for name in CONFIGS],
                  {"USE_TORCH_XLA": "0", "PYTHONPATH": FIXTURES / "huggingface", "DSX_TEST_HF_CPU_REFERENCE": "1"},
                  "fork")

    def _xla_job(self, launcher: str) -> None:
        runs = [self._run(name, launcher) for name, side in XLA_RUNS if side == launcher]
        extra_env, launcher_args = {}, ()
        if launcher in ("deepspeed", "accelerate"):
            extra_env = {"PYTHONPATH": FIXTURES / "huggingface", "DSX_TEST_HF_FAKE_TPU": "1",
                         "DSX_TEST_HF_RECORD": self.record}
        if launcher == "torchrun":
            runs += [self._run(name, "torchrun", resume=True) for name in RESUMED]
        if launcher == "accelerate":  # the job's accelerate config names the first run's DeepSpeed config
            config_file = _accelerate_config(self.root / "accelerate.yaml",
                                             Path(runs[0]["env"]["ACCELERATE_DEEPSPEED_CONFIG_FILE"]))
            launcher_args = ("--config_file", config_file)
        self._job(launcher, runs, extra_env, launcher, launcher_args)

    def run_all(self) -> None:
        with self._lock:
            if self.results:
                return
            save_model(self.model_dir)
            errors = []

            def guarded(*jobs):
                try:
                    for job in jobs:
                        job()
                except BaseException as error:  # every test of the module fails with the job's error
                    errors.append(error)

            # At once: a 2-rank job leaves a core idle while its processes start and while a rank compiles a graph
            # its peer waits for at a collective (the module took 276 s with the XLA jobs in turn, 139 s so).
            # torchrun after deepspeed: its job resumes from the deepspeed job's checkpoints.
            chains = [(self._cpu_job, ), (functools.partial(self._xla_job, "deepspeed"),
                                          functools.partial(self._xla_job, "torchrun")),
                      (functools.partial(self._xla_job, "accelerate"), )]
            threads = [threading.Thread(target=guarded, args=chain) for chain in chains]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise errors[0]
            for name, side in [*XLA_RUNS, *((name, "cpu") for name in CONFIGS)]:
                self.results[f"{name}/{side}"] = self._read(self.root / name / side / f"{name}.json")
            for name in RESUMED:
                self.results[f"{name}/resumed"] = self._read(self.root / name / "torchrun" / f"{name}-resumed.json")

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
    assert_weights_like(xla, cpu, "bfloat16" if bf16 else "float32", KEY_BIAS)


@pytest.mark.parametrize("name, launcher", XLA_RUNS, ids=[f"{name}-{launcher}" for name, launcher in XLA_RUNS])
def test_trainer_matches_cpu_accelerator(hf_runs, name, launcher):
    """Each configuration's Trainer run on XLA, through each launcher, trains like the CPU accelerator's, through a
    DeepSpeed engine of the config's ZeRO stage; LoRA trains only the adapter."""
    stage, bf16, lora, _ = CONFIGS[name]
    xla, cpu = hf_runs.results[f"{name}/{launcher}"], hf_runs.results[f"{name}/cpu"]
    assert_trains_like(xla, cpu, bf16)
    # TorchTPU's words (transformers' "tpu" device, "tpu_dist" backend) never take a torch_xla run.
    assert xla["device"].startswith("xla:") and "tpu" not in xla["backend"], (xla["device"], xla["backend"])
    for result in (xla, cpu):
        assert (result["engine"], result["zero_stage"]) == ("DeepSpeedEngine", stage)
        assert all(("lora_" in param) == lora for param in result["params"]), sorted(result["params"])
        assert result["built_partitioned"] == (stage == 3)


def test_tpu_vms_train_through_deepspeed_without_xla_bf16_variables(hf_runs):
    """The ``deepspeed`` and ``accelerate`` jobs' runs see a TPU as accelerate and transformers check for one: they
    still train through DeepSpeed (above), and no process of the jobs (the runners, their launchers, the workers)
    ever set XLA_USE_BF16 or XLA_DOWNCAST_BF16 (accelerate's TPU bf16)."""
    records = [json.loads(line) for line in hf_runs.record.read_text().splitlines()]
    assert sorted(record["rank"] for record in records if record["rank"] is not None) == ["0", "0", "1", "1"]
    assert all(record["XLA_USE_BF16"] is None and record["XLA_DOWNCAST_BF16"] is None for record in records)


@pytest.mark.parametrize("name", RESUMED)
def test_resume_from_trainer_checkpoint_continues_exactly(hf_runs, name):
    """``resume_from_checkpoint`` of the Trainer checkpoint the deepspeed run saved at step 3, in another job (the
    torchrun one): steps 4-6 log the uninterrupted run's losses and end with its weights."""
    whole, resumed = hf_runs.results[f"{name}/deepspeed"], hf_runs.results[f"{name}/resumed"]
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
        trained = hf_runs.results[f"{name}/deepspeed"]["params"]
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_runs.model_dir),
                                          hf_runs.root / name / "deepspeed" / "out" / "adapter")
        loaded = {param: p for param, p in model.named_parameters() if "lora_" in param}
        assert loaded.keys() == trained.keys()
        for param, p in loaded.items():
            assert within(p.detach().tolist(), trained[param], atol=1e-6, rtol=0), param


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_trainer_steps_read_the_device_only_to_log(hf_runs, launcher):
    """After warm-up a Trainer step compiles nothing and reads nothing back from the device; a logging step reads
    what it logs (the loss gathered over ranks, the gradient norm). The zero2-bf16 runs log every second step: the
    counters after step s cover step s and the logging of step s-1. The runs that save no checkpoint compile nothing
    after warm-up."""
    counters = dict((step, figures) for step, figures in hf_runs.results[f"zero2-bf16/{launcher}"]["step_counters"])
    steps = {step: {key: counters[step][key] - counters[step - 1][key] for key in counters[step]}
             for step in range(4, STEPS + 1)}
    assert all(figures["compilations"] == 0 for figures in steps.values()), steps
    assert steps[4]["transfers_to_host"] == steps[6]["transfers_to_host"] == 0, steps
    assert steps[5]["transfers_to_host"] > 0, steps
    assert steps[4]["executions"] == steps[6]["executions"], steps
    for name, side in XLA_RUNS:
        if side == launcher and not (launcher == "deepspeed" and name in RESUMED):
            counted = hf_runs.results[f"{name}/{side}"]["counters"]
            assert counted["end"]["compilations"] == counted["warm"]["compilations"], (name, counted)
