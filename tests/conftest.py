"""Shared fixtures. Everything runs on real XLA with PJRT CPU; processes that must stay free of the
XLA runtime (launchers, startup hook checks) run as subprocesses."""
import atexit
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from deepspeed_xla.bootstrap import PROCESS_ENV

# Tests compile PJRT CPU graphs at XLA's lowest backend optimization level, with XLA CPU's older
# elemental emitters instead of its per-fusion MLIR emitters, and as one LLVM module instead of parallel
# parts: the same HLO graphs, cheaper machine code (a bf16 run's gradient copies make hundreds of small
# fusions; two cores gain nothing from the parts). Results stay within the tolerances; the figures are in
# docs/performance.md ("Figures behind the code").
FAST_COMPILE = {"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                             "--xla_cpu_parallel_codegen_split_count=1"}

REPO = Path(__file__).resolve().parents[1]
#: Folders of ``sitecustomize.py`` files that a launched run puts on its PYTHONPATH to watch or break itself
#: (``cpuinfo_cache`` is on every ``clean_env``'s, unless a test names another).
FIXTURES = REPO / "tests" / "fixtures"
VENV_BIN = Path(sys.executable).parent

# Variables a test must not inherit from the developer's shell or from launcher parents.
_SCRUB_PREFIXES = ("DS_", "PJRT_", "TPU_", "XLA_", "CPU_NUM_DEVICES")
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
          "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


# Each launched run gets an empty HOME of its own (removed at exit), so that a developer's ~/.deepspeed_env (or
# any other dotfile) cannot change what a test sees. What the runs do need from the real HOME is passed by location:
# caches (pip's, matplotlib's, torch's) under XDG_CACHE_HOME, DeepSpeed's JIT-built ops in TORCH_EXTENSIONS_DIR (one
# per venv, as scripts/setup_env.sh sets it), pip's own configuration (its index) through PIP_CONFIG_FILE.
_REAL_HOME = Path.home()
_CPUINFO = "DSX_TEST_CPUINFO"
_KEPT_FROM_HOME = {
    "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or str(_REAL_HOME / ".cache"),
    "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or str(VENV_BIN.parent / "torch_extensions"),
}
_PIP_CONFIG = next((path for path in (Path(os.environ.get("XDG_CONFIG_HOME") or _REAL_HOME / ".config") / "pip" /
                                      "pip.conf", _REAL_HOME / ".pip" / "pip.conf") if path.is_file()), None)
if _PIP_CONFIG and "PIP_CONFIG_FILE" not in os.environ:
    _KEPT_FROM_HOME["PIP_CONFIG_FILE"] = str(_PIP_CONFIG)


@functools.lru_cache(maxsize=None)
def _homes() -> Path:
    """The folder of this process's launched runs' HOMEs (and of the session's py-cpuinfo answer), made when first
    asked for, not at import: a rank's process also imports this module, and one that ends without running ``atexit``
    would leave its folder behind."""
    homes = Path(tempfile.mkdtemp(prefix="dsx-test-homes-"))
    atexit.register(shutil.rmtree, homes, ignore_errors=True)
    return homes


def clean_env(**overrides) -> dict:
    """A child environment with no launcher/XLA state, PJRT CPU, the venv's tools first on PATH, a fresh, empty
    HOME (``HOME=`` in ``overrides`` picks another) and the session's py-cpuinfo answer (``fixtures/cpuinfo_cache``;
    a ``PYTHONPATH=`` override leaves it out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB}
    env.update(_KEPT_FROM_HOME)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FIXTURES / "cpuinfo_cache"), env.get("PYTHONPATH")]))
    env[_CPUINFO] = os.environ.get(_CPUINFO) or str(_homes() / "cpuinfo.json")
    env["HOME"] = tempfile.mkdtemp(dir=_homes())
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PJRT_DEVICE"] = "CPU"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(FAST_COMPILE)
    env.update({k: str(v) for k, v in overrides.items() if v is not None})
    for key in [k for k, v in overrides.items() if v is None]:
        env.pop(key, None)
    return env


def pytest_configure(config) -> None:
    """In-process tests use DeepSpeed with the XLA accelerator: set before a test module imports deepspeed. Here, not
    at import: a rank's code that imports this module (through ``tests.multiproc``) keeps the accelerator its
    environment names. The session's py-cpuinfo answer (``fixtures/cpuinfo_cache``) is one file for the pytest-xdist
    workers too, which inherit this process's environment."""
    if not os.environ.get(_CPUINFO):
        os.environ[_CPUINFO] = str(_homes() / "cpuinfo.json")
    os.environ["DS_ACCELERATOR"] = "xla"
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.update(FAST_COMPILE)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Work units of ``pytest -n`` (``--dist loadgroup``, as scripts/run_tests.sh runs the suite on two workers):
    a module's tests run on one worker, since its module fixtures launch the jobs they share; the modules using the
    ``trainings`` session fixture (each worker has its own) share one unit, unless a module names its own
    ``xdist_group``. Launched runs are scheduled first: the units that take longest start before the short ones that
    fill the end."""
    uses_trainings = {item.module.__name__ for item in items if "trainings" in item.fixturenames}
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            group = "trainings" if item.module.__name__ in uses_trainings else item.module.__name__
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: (item.module.__name__ not in uses_trainings,
                                 not item.module.__name__.startswith("tests.launched.")))


@pytest.fixture(autouse=True)
def _keeps_the_launch_environment():
    """A test that leaves a launcher or DeepSpeed variable set (a job secret, a rank) changes what the tests after it
    on the same worker see: it fails here, naming the variables, instead of one of them failing by the order of runs."""
    before = _launch_variables()
    yield
    after = _launch_variables()
    changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    for key in changed:  # put back, so that only this test fails
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]
    assert not changed, f"the test left os.environ changed: {changed} (use the launch_env fixture or monkeypatch)"


def _launch_variables() -> dict:
    """Not XLA's own variables: importing torch_xla adds to ``XLA_FLAGS``; nor the record of what this process set for
    itself alone (``deepspeed_xla.process_env``), which grows when a test first uses the device."""
    return {k: v for k, v in os.environ.items() if (k.startswith("DS_") or k in _SCRUB) and k != PROCESS_ENV}


@pytest.fixture
def launch_env(monkeypatch):
    """For a test whose code sets launcher variables in this process (the runner's job secret, the rank variables a
    process started without a launcher gives itself): they start unset and are undone after it."""
    from deepspeed_xla.bootstrap import JOB_SECRET
    for name in (*_SCRUB, JOB_SECRET):
        monkeypatch.setenv(name, "")  # recorded: what the code under test sets is undone too
        monkeypatch.delenv(name)


@pytest.fixture
def env():
    return clean_env


@pytest.fixture
def xla_device():
    """This process's XLA device, with torch_xla imported (PJRT CPU)."""
    from deepspeed_xla import xla_runtime
    xla_runtime.torch_xla()
    return xla_runtime.device()


@pytest.fixture(scope="session")
def train_module():
    """``scripts/train.py`` as a module (its TinyGPT), loaded without running it."""
    from deepspeed_xla.bench.example import load_example
    return load_example(str(REPO / "scripts" / "train.py"))


@pytest.fixture(scope="session")
def trainings(tmp_path_factory):
    """``tests.multiproc.Trainings``: ``scripts/train.py`` runs that tests share (each distinct run once a session)."""
    from tests.multiproc import Trainings
    trainings = Trainings(tmp_path_factory.mktemp("trainings"))
    yield trainings
    trainings.close()


STEP_GRAPH_DIM = 64  # the bench model's width; docs/performance.md records width 256 ('The targets')
SMALL_BUCKET = 5000  # elements: below the model's larger parameters (12,288 and 16,384), so they split over buckets
#: The depths asserted: 16 layers are traced, not compiled (``--no-compile``): compiling every system's 16-layer step
#: graph, fp32 and bf16, takes about 6 minutes of CPU.
STEP_GRAPH_DEPTHS = (2, 16)


def _counted_cases(tmp_path: Path, name: str, *flags: str) -> list:
    """``python -m deepspeed_xla.bench.step_graphs`` on the bench's model at ``STEP_GRAPH_DIM`` with ``flags``."""
    import json

    from tests.multiproc import run_command
    out = tmp_path / f"{name}.json"
    proc = run_command([sys.executable, "-m", "deepspeed_xla.bench.step_graphs", "--workdir", str(tmp_path / name),
                        "--out", str(out), "--dim", str(STEP_GRAPH_DIM), *flags], 1800, cwd=REPO, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def step_graph_cases(tmp_path_factory):
    """The floor and ZeRO 0-3, fp32 and bf16: traced at ``STEP_GRAPH_DEPTHS`` and executed at 2 layers (one process
    per system, a child per case; the executed ones also written as StableHLO with their buffer donors, which
    tests/bench/test_tpu_compile.py compiles for TPUs); and ZeRO 1-3 at 2 layers in fp32 with ``reduce_bucket_size``
    below the largest parameters. The modules that use it share an ``xdist_group``, so it runs once."""
    tmp_path = tmp_path_factory.mktemp("step_graphs")
    return {"traced": _counted_cases(tmp_path, "traced", "--no-compile", "--layers", *map(str, STEP_GRAPH_DEPTHS)),
            "executed": _counted_cases(tmp_path, "executed", "--layers", "2", "--stablehlo"),
            "small_bucket": _counted_cases(tmp_path, "small_bucket", "--systems", "zero1", "zero2", "zero3",
                                           "--dtypes", "fp32", "--layers", "2", "--zero",
                                           f"reduce_bucket_size={SMALL_BUCKET}")}
