"""``ds_xla_report``: can this host run ``DS_ACCELERATOR=xla deepspeed ...``? DeepSpeed's ``ds_report`` for XLA.

It reports what the ``deepspeed`` runner would see (``.deepspeed_env`` applied): package versions, the
device type and its devices, the startup hook, the accelerator choice and the op builders, then every
problem with its fix, and exits 1 when the setup cannot work. It runs on launcher hosts, so it never
imports torch_xla nor starts the XLA runtime (that would lock the TPU chips): versions come from package
metadata and devices from the device type's PCI/environment count.
"""
import argparse
import os
import re
import shutil
import site
import sys
from importlib import metadata
from typing import Dict, List, Mapping, Optional, Tuple

from deepspeed_xla import bootstrap
from deepspeed_xla.devices import UNSET_ON_CPU_WARNING, default_device_name, device_type_named, wants_xla
from deepspeed_xla.env_file import apply_deepspeed_env, read_env_files
from deepspeed_xla.xla_runtime import installed_version, pair_problem

DIST = "deepspeed-xla"
OK, WARNING, FAIL = "OK", "WARNING", "FAIL"
_COLORS = {OK: "\033[92m", WARNING: "\033[93m", FAIL: "\033[91m"}
_END = "\033[0m"
_LABEL_WIDTH = 34
# .deepspeed_env values that must not end up in a pasted report.
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_KEY|ACCESS_KEY", re.IGNORECASE)
# deepspeed --launcher NAME -> the programs DeepSpeed's runner needs for it on this host (the one its
# backend_exists() looks for, and the one it runs).
LAUNCHER_PROGRAMS = {"pdsh": ("pdsh", "ssh"), "openmpi": ("mpirun", "ompi_info"), "mpich": ("mpirun", ),
                     "impi": ("mpirun", ), "mvapich": ("mpirun", "mpiname"), "slurm": ("srun", "sinfo")}


class Report:
    """Rows grouped in sections, plus the problems (fatal) and warnings they raised."""

    def __init__(self) -> None:
        self.lines: List[Tuple[str, str, Optional[str]]] = []
        self.findings: List[Tuple[str, str]] = []

    def section(self, title: str) -> None:
        self.lines.append((title, "", None))

    def row(self, label: str, value: str, status: Optional[str] = None) -> None:
        self.lines.append((label, value, status))

    def fail(self, message: str) -> str:
        self.findings.append((FAIL, message))
        return FAIL

    def warn(self, message: str) -> str:
        self.findings.append((WARNING, message))
        return WARNING

    @property
    def failed(self) -> bool:
        return any(level == FAIL for level, _ in self.findings)

    def render(self, color: bool) -> str:

        def tag(status):
            return f"{_COLORS[status]}[{status}]{_END}" if color else f"[{status}]"

        out = ["deepspeed-xla environment report (ds_xla_report)"]
        for label, value, status in self.lines:
            if not value and status is None:
                out.append(f"\n{label}")
                continue
            dots = "." * max(2, _LABEL_WIDTH - len(label))
            out.append(f"  {label} {dots} {value}" + (f" {tag(status)}" if status else ""))
        out.append("")
        for level, message in sorted(self.findings, key=lambda finding: finding[0] != FAIL):
            out.append(f"{tag(level)} {message}")
        problems = sum(level == FAIL for level, _ in self.findings)
        out.append(f"Result: {problems} problem(s); fix them and run ds_xla_report again." if problems else
                   "Result: this host can run DS_ACCELERATOR=xla deepspeed ...")
        return "\n".join(out)


def required_versions() -> Dict[str, Tuple[Optional[str], bool]]:
    """``{distribution: (version specifier, needed)}``: deepspeed-xla's own requirements (needed), the Hugging Face
    releases its ``hf`` extra names (transformers, accelerate, peft, kernels: the range the patches are tested with;
    needed only for the Hugging Face path) and libtpu at the version torch_xla's ``tpu`` extra pins (only on TPU
    hosts, so not needed here)."""
    from packaging.requirements import Requirement
    wanted: Dict[str, Tuple[Optional[str], bool]] = {}
    for dist, extra, needed in ((DIST, "", True), (DIST, "hf", False), ("torch_xla", "tpu", False)):
        try:
            requirements = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requirements:
            requirement = Requirement(text)
            applies = requirement.marker.evaluate({"extra": extra}) if requirement.marker else not extra
            if applies:
                wanted.setdefault(requirement.name, (str(requirement.specifier) or None, needed))
    return wanted


def check_versions(report: Report, installed: Mapping[str, Optional[str]],
                   required: Mapping[str, Tuple[Optional[str], bool]]) -> None:
    """Rows for the installed versions against the supported ones; a torch/torch_xla pair that cannot load
    or a missing requirement is a problem, a version outside the tested combination a warning."""
    from packaging.specifiers import SpecifierSet
    pair = ("torch", "torch_xla")
    broken_pair = pair_problem(installed.get(pair[0]), installed.get(pair[1]))
    if broken_pair:
        report.fail(broken_pair)
    statuses = []
    for name, (spec, needed) in required.items():
        version = installed.get(name)
        wanted = f"{name}{spec or ''}"
        if broken_pair and name in pair:
            status = FAIL
        elif version is None:
            status = report.fail(f"{name} is not installed: pip install '{wanted}'.") if needed else None
        elif spec is None or SpecifierSet(spec).contains(version, prereleases=True):
            status = OK
        else:
            status = report.warn(f"{name} {version} is outside the tested combination: pip install '{wanted}'.")
        statuses.append(status)
        report.row(name, f"{version or 'not installed'} (supported: {wanted})", status)
    supported = all(status in (OK, None) for status in statuses)
    report.row("supported combination", "yes" if supported else "no",
               OK if supported else FAIL if FAIL in statuses else WARNING)


def _masked(key: str, value: str) -> str:
    return "***" if _SECRET.search(key) else value


def check_env_files(report: Report, shell: Mapping[str, str]) -> None:
    """List the ``.deepspeed_env`` files and what they set, then apply them to this process as the runner does."""
    try:
        files = read_env_files()
    except (OSError, ValueError) as exc:
        report.row(".deepspeed_env", "unreadable", report.fail(str(exc)))
        return
    if not files:
        report.row(".deepspeed_env", "none (looked in ~ and the current directory)")
    for path, values in files:
        settings = []
        for key, value in values.items():
            overridden = key in shell and shell[key] != value
            settings.append(f"{key}={_masked(key, value)}" + (" (the shell's value wins)" if overridden else ""))
        report.row(path, ", ".join(settings) or "(sets nothing)")
    apply_deepspeed_env(os.environ)


def _source(key: str, shell: Mapping[str, str]) -> str:
    """The variable's value and where it came from (the shell, or a ``.deepspeed_env`` file)."""
    if key not in os.environ:
        return "unset"
    return f"{os.environ[key]} (from {'the shell' if key in shell else '.deepspeed_env'})"


def check_device(report: Report, shell: Mapping[str, str]) -> None:
    """The device type ``PJRT_DEVICE`` selects and its devices, counted without starting the runtime."""
    value = os.environ.get("PJRT_DEVICE", "")
    if value.strip():
        report.row("PJRT_DEVICE", _source("PJRT_DEVICE", shell))
    else:
        value = default_device_name()
        report.row("PJRT_DEVICE", f"unset, so {value}", report.warn(UNSET_ON_CPU_WARNING) if value == "CPU" else None)
    try:
        device_type = device_type_named(value)
        description, count = device_type.describe(), device_type.local_device_count()
    except ValueError as exc:
        report.row("device type", "unusable", report.fail(str(exc)))
        return
    report.row("device type", device_type.pjrt_name)
    report.row("devices", description)
    report.row("device count", str(count))
    if device_type.unverified:
        report.row("hardware status", device_type.unverified, report.warn(device_type.unverified))
    for problem in device_type.setup_problems():
        report.fail(problem)


def _pth_locations() -> List[str]:
    folders = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return [os.path.join(folder, bootstrap.PTH_FILE) for folder in folders]


def check_accelerator(report: Report, shell: Mapping[str, str]) -> None:
    """The startup hook (``deepspeed_xla.pth``) and whether DeepSpeed will pick the XLA accelerator."""
    locations = _pth_locations()
    installed = [path for path in locations if os.path.isfile(path)]
    active = bootstrap.is_active()
    state = f"{'installed: ' + installed[0] if installed else 'not installed'}; {'active' if active else 'inactive'}"
    if os.environ.get(bootstrap.DISABLE_VARIABLE) == "1":
        status = report.fail(f"The startup hook is disabled by {bootstrap.DISABLE_VARIABLE}="
                             f"{_source(bootstrap.DISABLE_VARIABLE, shell)}, so "
                             f"DeepSpeed rejects DS_ACCELERATOR=xla: unset {bootstrap.DISABLE_VARIABLE}.")
        state = f"{state} (disabled)"
    elif not installed and not active:
        status = report.fail(f"The startup hook {bootstrap.PTH_FILE} is not in this interpreter's site-packages "
                             f"({', '.join(os.path.dirname(path) for path in locations)}): install deepspeed-xla "
                             f"with pip into {sys.prefix} (pip install . in its source tree).")
    elif not active:
        status = report.fail("The startup hook is installed but did not run in this interpreter (python -S skips "
                             "site-packages startup files): run Python without -S.")
    else:
        status = OK
    report.row("startup hook", state, status)
    requested = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if wants_xla():
        report.row("DS_ACCELERATOR", _source("DS_ACCELERATOR", shell) if requested else
                   f"unset, so {bootstrap.ACCELERATOR_NAME} (TPU chips on PCI)", OK)
    else:
        report.row("DS_ACCELERATOR", _source("DS_ACCELERATOR", shell), report.warn(
            f"DeepSpeed will use its {'own default' if not requested else repr(requested)} accelerator, not XLA: "
            "set DS_ACCELERATOR=xla (in the shell or in .deepspeed_env)."))


def check_op_builders(report: Report) -> None:
    """What each DeepSpeed op builder name gives under the XLA accelerator (``deepspeed_xla.op_builder``)."""
    try:
        from deepspeed.ops import op_builder as upstream
        from deepspeed.ops.op_builder.builder import probe_is_compatible
    except Exception as exc:  # noqa: BLE001 - any failure of `import deepspeed` is what the user must see
        report.row("import deepspeed", "failed", report.fail(f"import deepspeed failed ({type(exc).__name__}: {exc}); "
                                                             "the problems above are the likely cause."))
        return
    from torch.utils.cpp_extension import is_ninja_available

    from deepspeed_xla.op_builder import create_op_builder
    from deepspeed_xla.op_builder.builder import PythonOpBuilder
    from deepspeed_xla.op_builder.no_impl import NotImplementedBuilder
    names = sorted(name for name in vars(upstream) if name.endswith("Builder")
                   and name not in ("OpBuilder", "CUDAOpBuilder", NotImplementedBuilder.__name__))
    unavailable, by_torch_distributed = [], []
    for name in names:
        builder = create_op_builder(name)
        if builder is None:
            by_torch_distributed.append(name)
        elif isinstance(builder, NotImplementedBuilder):
            unavailable.append(name)
        elif isinstance(builder, PythonOpBuilder):
            report.row(f"{name} ({builder.name})", "pure torch, traced into XLA graphs", OK)
        else:
            report.row(f"{name} ({builder.name})", "host op, JIT-built with the C++ compiler",
                       OK if probe_is_compatible(builder) else report.warn(
                           f"{name} is not compatible with this host (DeepSpeed's is_compatible() is False): "
                           "ZeRO-Offload with it will fail; see DeepSpeed's ds_report for why."))
    ninja = is_ninja_available()
    report.row("ninja (JIT builds)", "found" if ninja else "not found", OK if ninja else report.warn(
        "ninja is missing, so host ops (ZeRO-Offload's cpu_adam, ...) cannot be JIT-built: pip install ninja."))
    report.row("via torch.distributed", ", ".join(by_torch_distributed))
    report.row("no XLA implementation", ", ".join(unavailable))


def list_refused_settings(report: Report) -> None:
    """The DeepSpeed config settings ``deepspeed.initialize`` refuses on XLA, so a user learns of them before a run."""
    try:
        import deepspeed  # noqa: F401 - first: it binds the accelerator's op builders that config_checks imports
        from deepspeed_xla.config_checks import refused_settings
    except Exception as exc:  # noqa: BLE001 - the op builder section has reported the failed import
        report.row("refused settings", f"unknown ({type(exc).__name__}: {exc})")
        return
    for setting, instead in refused_settings():
        report.row(setting, f"refused; use {instead}")


def _found(program: str, path: Optional[str]) -> str:
    if path is None:
        return f"{program}: not found"
    real = os.path.basename(os.path.realpath(path))
    return f"{program}: {path}" + (f" ({real})" if real != program else "")


def check_launchers(report: Report) -> None:
    """Which ``deepspeed --launcher`` backends this host has the programs for, found on PATH (none is run)."""
    for launcher, programs in LAUNCHER_PROGRAMS.items():
        paths = {program: shutil.which(program) for program in programs}
        missing = [program for program, path in paths.items() if path is None]
        state = "usable" if not missing else f"missing {', '.join(missing)}"
        report.row(f"--launcher {launcher}", f"{state}; {', '.join(_found(*item) for item in paths.items())}")
    try:
        mpi4py = f"{metadata.version('mpi4py')}"
    except metadata.PackageNotFoundError:
        mpi4py = ("not installed (DeepSpeed asks it for ranks only where mpirun starts a script without the "
                  "deepspeed runner and without MASTER_ADDR/MASTER_PORT)")
    report.row("mpi4py", mpi4py)


def build_report() -> Report:
    """Every section, as the ``deepspeed`` runner would see this host: ``.deepspeed_env`` is applied to this
    process's environment first."""
    import deepspeed_xla
    report = Report()
    shell = dict(os.environ)
    report.section("Versions (from package metadata)")
    try:
        required = required_versions()
        check_versions(report, {name: installed_version(name) for name in required}, required)
    except ImportError as exc:  # packaging comes with DeepSpeed
        report.fail(f"Cannot compare versions ({exc}): pip install packaging.")
    report.row(DIST, f"{installed_version(DIST) or 'not installed'} at {os.path.dirname(deepspeed_xla.__file__)}")
    report.section(".deepspeed_env files (applied by the deepspeed runner; the shell wins)")
    check_env_files(report, shell)
    report.section("Device (counted without starting the XLA runtime)")
    check_device(report, shell)
    report.section("Accelerator")
    check_accelerator(report, shell)
    report.section("DeepSpeed op builders under the XLA accelerator")
    check_op_builders(report)
    report.section("DeepSpeed config settings refused at deepspeed.initialize (docs/bad_input.md)")
    list_refused_settings(report)
    report.section("Multi-node launchers (programs found on PATH; none is started)")
    check_launchers(report)
    return report


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ds_xla_report", description=(
        "Check that this host can run DS_ACCELERATOR=xla deepspeed ...: versions, device, startup hook, "
        ".deepspeed_env and op builders. Exits 1 when the setup cannot work. Never starts the XLA runtime."))
    parser.parse_args(argv)
    report = build_report()
    print(report.render(color=sys.stdout.isatty() and "NO_COLOR" not in os.environ))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
