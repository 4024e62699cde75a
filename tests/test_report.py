"""``ds_xla_report``: the facts it prints, its exit code, and that it never imports torch_xla (it runs on
launcher hosts, where starting the XLA runtime would lock the TPU chips)."""
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from deepspeed_xla import report
from deepspeed_xla.patches import registry
from deepspeed_xla.devices.cpu import CpuDevice
from deepspeed_xla.devices.tpu import TpuDevice
from tests.conftest import FIXTURES, VENV_BIN, clean_env
from tests.multiproc import run_command

PROBE_DIR = FIXTURES / "runtime_probe"
# A TPU VM with four v5e chips, as tpu-info's PCI scan would report it.
FAKE_TPU_HOST = ("import sys\nfrom tpu_info import device\n"
                 "device.get_local_chips = lambda: (device.TpuChip.V5E, 4)\n"
                 "from deepspeed_xla.report import main\nsys.exit(main())\n")


def _report(command, cwd: Path, **env) -> subprocess.CompletedProcess:
    """Run the report in ``cwd`` with an empty HOME (no developer ``~/.deepspeed_env``); every Python process it
    ran must have left torch_xla unimported (tests/fixtures/runtime_probe records that at exit)."""
    log, home = cwd / "runtime.jsonl", cwd / "home"
    home.mkdir()
    proc = run_command(command, 300, cwd=cwd,
                       env=clean_env(HOME=home, PYTHONPATH=PROBE_DIR, DSX_TEST_RUNTIME_LOG=log, **env))
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert records, proc.stderr[-3000:]
    assert not any(record["torch_xla_imported"] for record in records), records
    return proc


def _row(out: str, label: str) -> str:
    match = re.search(rf"^  {re.escape(label)} \.+ (.*)$", out, re.MULTILINE)
    assert match, f"no row {label!r} in:\n{out}"
    return match.group(1)


def test_healthy_cpu_host_with_deepspeed_env(tmp_path, monkeypatch):
    (tmp_path / ".deepspeed_env").write_text("\n# cluster\nexport DS_ACCELERATOR=xla\nCPU_NUM_DEVICES=3\n"
                                             "WANDB_API_KEY=s3cr3t\n")
    proc = _report([str(VENV_BIN / "ds_xla_report")], tmp_path, PJRT_DEVICE="CPU")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    for name in ("torch", "torch_xla", "deepspeed", "tpu-info", *registry.SUPPORTED):
        row = _row(out, name)
        assert row.startswith(f"{metadata.version(name)} (supported: {name}") and row.endswith("[OK]"), row
    assert _row(out, "supported combination") == "yes [OK]"
    assert _row(out, "./.deepspeed_env") == "DS_ACCELERATOR=xla, CPU_NUM_DEVICES=3, WANDB_API_KEY=***"
    assert "s3cr3t" not in out
    assert _row(out, "PJRT_DEVICE") == "CPU (from the shell)"
    assert _row(out, "device type") == "CPU"
    monkeypatch.setenv("CPU_NUM_DEVICES", "3")  # what the runner applies from the file
    assert _row(out, "device count") == str(CpuDevice().local_device_count())
    assert _row(out, "startup hook").endswith("deepspeed_xla.pth; active [OK]")
    assert _row(out, "DS_ACCELERATOR") == "xla (from .deepspeed_env) [OK]"
    assert _row(out, "FusedAdamBuilder (fused_adam)") == "pure torch, traced into XLA graphs [OK]"
    assert "TransformerBuilder" in _row(out, "no XLA implementation")
    deepcompile = _row(out, '"compile": {"deepcompile": true}')
    assert deepcompile == "refused; use engine.compile() (torch.compile, openxla backend)"
    assert "hardware status" not in out  # PJRT CPU is what CI runs
    assert "[FAIL]" not in out and "\033[" not in out  # a pipe gets no colour
    assert out.rstrip().endswith("Result: this host can run DS_ACCELERATOR=xla deepspeed ...")


def test_faked_tpu_host(tmp_path, monkeypatch):
    libtpu = tmp_path / "libtpu.so"
    libtpu.touch()
    proc = _report([sys.executable, "-c", FAKE_TPU_HOST], tmp_path, PJRT_DEVICE="TPU", DS_ACCELERATOR="xla",
                   TPU_LIBRARY_PATH=libtpu)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    from tpu_info import device
    monkeypatch.setattr(device, "get_local_chips", lambda: (device.TpuChip.V5E, 4))
    assert _row(out, "device type") == "TPU"
    assert _row(out, "device count") == str(TpuDevice().local_device_count()) == "4"
    assert _row(out, "devices") == f"4 x TPU v5e chip; libtpu: {libtpu}"
    assert _row(out, "hardware status") == f"{TpuDevice.unverified} [WARNING]"


def test_unknown_pjrt_device_fails_with_the_fix(tmp_path):
    proc = _report([sys.executable, "-m", "deepspeed_xla.report"], tmp_path, PJRT_DEVICE="FPGA", DS_ACCELERATOR="xla")
    assert proc.returncode == 1, proc.stdout
    assert _row(proc.stdout, "device type") == "unusable [FAIL]"
    assert "[FAIL] PJRT_DEVICE='FPGA' is not supported by deepspeed_xla; set PJRT_DEVICE to one of" in proc.stdout
    assert "Result: 1 problem(s)" in proc.stdout


def test_disabled_hook_is_reported_inactive(tmp_path):
    proc = _report([str(VENV_BIN / "ds_xla_report")], tmp_path, DS_XLA_DISABLE_HOOK=1, DS_ACCELERATOR="xla")
    assert proc.returncode == 1, proc.stdout
    assert _row(proc.stdout, "startup hook").endswith("; inactive (disabled) [FAIL]")
    assert ("[FAIL] The startup hook is disabled by DS_XLA_DISABLE_HOOK=1 (from the shell), so DeepSpeed rejects "
            "DS_ACCELERATOR=xla: unset DS_XLA_DISABLE_HOOK.") in proc.stdout


def _check(installed) -> report.Report:
    checked = report.Report()
    report.check_versions(checked, installed, report.required_versions())
    return checked


def _installed(**versions):
    names = report.required_versions()
    return {**{name: metadata.version(name) for name in names if name != "libtpu"}, "libtpu": None, **versions}


def test_version_check_on_this_install_finds_nothing():
    assert _check(_installed()).findings == []


def test_torch_and_torch_xla_mismatch_is_a_problem_with_the_fix():
    checked = _check(_installed(torch="2.8.0+cu128", torch_xla="2.9.0"))
    assert checked.failed
    assert any("not a matching pair" in message and "pip install torch==2.9.0 or torch_xla==2.8.0" in message
               for level, message in checked.findings if level == report.FAIL)
    assert ("supported combination", "no", report.FAIL) in checked.lines


def test_untested_but_matching_versions_only_warn():
    spec = report.required_versions()["deepspeed"][0]
    checked = _check(_installed(torch="2.8.0", torch_xla="2.8.0", deepspeed="0.19.9"))
    assert not checked.failed
    messages = [message for level, message in checked.findings if level == report.WARNING]
    assert any(m.startswith("torch 2.8.0 is outside the tested combination") for m in messages), messages
    assert f"deepspeed 0.19.9 is outside the tested combination: pip install 'deepspeed{spec}'." in messages
    assert ("supported combination", "no", report.WARNING) in checked.lines


def test_hugging_face_releases_checked_against_the_range_the_patches_are_tested_with():
    """transformers, accelerate, peft and kernels come from the ``hf`` extra, made from ``registry.SUPPORTED``: each end
    of a range is in it, a release past it warns with the range, and a missing one is no problem (the Hugging Face path
    is optional)."""
    from packaging.requirements import Requirement
    required = report.required_versions()
    for name in registry.SUPPORTED:
        assert required[name] == (str(Requirement(registry.requirement(name)).specifier), False)
    lowest, highest = registry.supported("transformers")
    assert _check(_installed(transformers=lowest)).findings == _check(_installed(transformers=highest)).findings == []
    checked = _check(_installed(transformers="5.26.0", peft=None))
    assert checked.findings == [(report.WARNING, "transformers 5.26.0 is outside the tested combination: pip install "
                                                 f"'transformers{required['transformers'][0]}'.")]
    assert ("peft", f"not installed (supported: peft{required['peft'][0]})", None) in checked.lines


def test_missing_requirement_is_a_problem_with_the_fix():
    spec = report.required_versions()["deepspeed"][0]
    checked = _check(_installed(deepspeed=None))
    assert (report.FAIL, f"deepspeed is not installed: pip install 'deepspeed{spec}'.") in checked.findings
    checked = _check(_installed(torch_xla=None))
    assert any("needs torch_xla installed" in message for level, message in checked.findings if level == report.FAIL)


def test_colour_only_when_asked():
    checked = report.Report()
    checked.row("x", "y", checked.warn("w"))
    assert "\033[93m[WARNING]" in checked.render(color=True)
    assert "\033[" not in checked.render(color=False)


def test_launchers_found_on_path_none_started(tmp_path):
    """pdsh and ssh present, srun without sinfo, no MPI: the rows say so and no program was run."""
    fake_bin, ran = tmp_path / "bin", tmp_path / "ran.txt"
    fake_bin.mkdir()
    for program in ("pdsh", "ssh", "srun"):
        (fake_bin / program).write_text(f"#!/bin/sh\necho {program} >> {ran}\n")
        (fake_bin / program).chmod(0o755)
    proc = _report([str(VENV_BIN / "ds_xla_report")], tmp_path, PJRT_DEVICE="CPU", DS_ACCELERATOR="xla",
                   PATH=f"{fake_bin}:{VENV_BIN}")
    out = proc.stdout
    assert _row(out, "--launcher pdsh") == f"usable; pdsh: {fake_bin / 'pdsh'}, ssh: {fake_bin / 'ssh'}"
    assert _row(out, "--launcher slurm") == f"missing sinfo; srun: {fake_bin / 'srun'}, sinfo: not found"
    assert _row(out, "--launcher openmpi") == "missing mpirun, ompi_info; mpirun: not found, ompi_info: not found"
    assert not ran.exists(), ran.read_text()


def test_every_refused_setting_is_listed():
    """Each check of ``config_checks`` has its row: a new refusal cannot be left out of the report."""
    listed = report.Report()
    report.list_refused_settings(listed)
    from deepspeed_xla import config_checks
    checks = {check for name, check in vars(config_checks).items() if name.endswith("_problem")}
    assert checks == set(config_checks._CHECKS)
    rows = {label: value for label, value, _ in listed.lines}
    assert len(rows) == len(checks) and all(value.startswith("refused; use ") for value in rows.values()), rows
    assert rows['1-bit optimizers ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")'] == 'refused; use "Adam"/"AdamW", "Lamb"'
