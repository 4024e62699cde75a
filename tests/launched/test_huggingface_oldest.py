"""The Hugging Face path on the oldest releases the patches support (``registry.SUPPORTED``; the venv holds the
newest, which ``test_huggingface.py`` runs in full): a smoke of one 2-process Trainer run (ZeRO-2) per launcher,
against the same run on DeepSpeed's CPU accelerator, and the patch table's digests at those releases.

``scripts/run_tests.sh`` installs the oldest releases (``registry.oldest_requirements()``, without dependencies) into a
folder of the venv and names it in ``DSX_HF_OLDEST``; these runs put it first on PYTHONPATH.
"""
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deepspeed_xla.patches import registry
from tests.conftest import FIXTURES, REPO
from tests.launched.test_huggingface import (HF_TRAIN, LAUNCHERS, TRAINER_ARGS, TRAIN_MANY, _accelerate_config,
                                             assert_trains_like, ds_config, save_model)
from tests.multiproc import launch_command, run_forked_job, run_job, run_python

STAGE = 2
# What a release inside the supported range must never print (patches/__init__.py, patches/registry.py).
RANGE_WARNINGS = ("is outside the releases its patches are tested with", "differs from")
DIGESTS = """
import json
from tests.patches.test_table import files_as_recorded
print(json.dumps(files_as_recorded()))
"""


def oldest_folder() -> Path:
    folder = os.environ.get("DSX_HF_OLDEST")
    if not folder or not (Path(folder) / ".complete").is_file():
        pytest.fail("The oldest supported Hugging Face releases are not installed: run the tests through "
                    "scripts/run_tests.sh (it installs registry.oldest_requirements() into $DSX_VENV/hf-oldest-<hash> "
                    "and sets DSX_HF_OLDEST).")
    return Path(folder)


def _run_args(workdir: Path, out: Path, accelerate: bool) -> dict:
    """One ``train_many`` run of ``scripts/hf_train.py``: ZeRO-2 fp32, DeepSpeed's WarmupLR (test_huggingface's
    ``zero2``), its results to ``out``; under ``accelerate launch`` the DeepSpeed config comes from the run's env."""
    config_path = workdir / "ds_config.json"
    config_path.write_text(json.dumps(ds_config(STAGE)))
    args = list(map(str, [*TRAINER_ARGS, "--model_dir", workdir.parent / "model", "--results_out", out,
                          "--output_dir", workdir / "out"]))
    if accelerate:
        return {"args": args, "env": {"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config_path)}}
    return {"args": [*args, "--deepspeed", str(config_path)]}


def _plan(workdir: Path, launcher: str) -> Path:
    workdir.mkdir(parents=True)
    plan = workdir / "runs.json"
    plan.write_text(json.dumps([_run_args(workdir, workdir / "result.json", launcher == "accelerate")]))
    return plan


def _result(workdir: Path) -> dict:
    result = json.loads((workdir / "result.json").read_text())
    result["other_ranks"] = [json.loads((workdir / "result.json.rank1").read_text())]
    return result


def _cpu_job(root: Path, folder: Path) -> None:
    plan = _plan(root / "cpu", "cpu")
    run_forked_job("tests.train_many:main", "cpu", 2, {
        "USE_TORCH_XLA": "0", "PYTHONPATH": f"{folder}{os.pathsep}{FIXTURES / 'huggingface'}",
        "DSX_TEST_HF_CPU_REFERENCE": "1"}, timeout=600, args=["--script", HF_TRAIN, "--runs", plan])


def _xla_job(root: Path, folder: Path, launcher: str) -> str:
    """One launcher's job; its output."""
    plan = _plan(root / launcher, launcher)
    launcher_args = ()
    if launcher == "accelerate":
        config = json.loads(plan.read_text())[0]["env"]["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
        launcher_args = ("--config_file", _accelerate_config(root / "accelerate.yaml", Path(config)))
    cmd, env = launch_command([TRAIN_MANY, "--script", HF_TRAIN, "--runs", plan], "xla", 2, {
        "PYTHONPATH": f"{folder}{os.pathsep}{FIXTURES / 'cpuinfo_cache'}"}, launcher, launcher_args)
    proc = run_job(cmd, env, root / launcher, 600)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def oldest_runs(tmp_path_factory) -> dict:
    """The model every run starts from (test_huggingface's, saved on the host with the newest transformers), the CPU
    accelerator's run (forked ranks) and one launched XLA job per launcher, all importing the oldest releases, all at
    once: a job is mostly its processes starting one after the other, which leaves a core idle (the fixture took
    128 s with the XLA jobs in turn, 61 s so). Results and output."""
    folder, root = oldest_folder(), tmp_path_factory.mktemp("huggingface-oldest")
    save_model(root / "model")
    with ThreadPoolExecutor(max_workers=1 + len(LAUNCHERS)) as pool:
        cpu = pool.submit(_cpu_job, root, folder)
        jobs = {launcher: pool.submit(_xla_job, root, folder, launcher) for launcher in LAUNCHERS}
        outputs = {launcher: job.result() for launcher, job in jobs.items()}
        cpu.result()
    return {"root": root, "outputs": outputs, "cpu": _result(root / "cpu"),
            **{launcher: _result(root / launcher) for launcher in LAUNCHERS}}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_trainer_on_the_oldest_releases_matches_cpu_accelerator(oldest_runs, launcher):
    """Each launcher's run imported the oldest releases, said nothing about their range, and trained through a
    ZeRO-2 engine like the CPU accelerator's run."""
    xla, cpu = oldest_runs[launcher], oldest_runs["cpu"]
    oldest = {name: registry.supported(name)[0] for name in ("transformers", "accelerate")}
    assert xla["versions"] == cpu["versions"] == oldest
    assert not [line for line in oldest_runs["outputs"][launcher].splitlines()
                if any(warning in line for warning in RANGE_WARNINGS)]
    assert (xla["engine"], xla["zero_stage"]) == (cpu["engine"], cpu["zero_stage"]) == ("DeepSpeedEngine", STAGE)
    assert_trains_like(xla, cpu, bf16=False)


def test_patch_table_digests_at_the_oldest_releases():
    """Every file and function a patch reads, at the oldest releases, has the digest the table records for them."""
    proc = run_python(DIGESTS, cwd=REPO, DS_ACCELERATOR="xla",
                      PYTHONPATH=f"{oldest_folder()}{os.pathsep}{REPO}{os.pathsep}{FIXTURES / 'cpuinfo_cache'}")
    assert proc.returncode == 0, proc.stderr[-6000:]
    installed, recorded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any(name.startswith("transformers.") for name in installed)
    assert installed == recorded
