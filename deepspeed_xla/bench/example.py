"""The example the bench trains: a deepspeed-xla checkout's ``scripts/train.py`` (its TinyGPT and batches)."""
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Optional


def find_train_script(explicit: Optional[str]) -> Path:
    """scripts/train.py: from ``--train-script``, the working directory, or the checkout this package runs from."""
    candidates = [Path(explicit)] if explicit else [Path.cwd() / "scripts" / "train.py",
                                                   Path(__file__).resolve().parents[2] / "scripts" / "train.py"]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    raise SystemExit(f"deepspeed_xla.bench trains the model of a deepspeed-xla checkout's scripts/train.py, which is "
                     f"not at {' or '.join(map(str, candidates))}: run it from the repository root or pass "
                     "--train-script PATH/TO/train.py.")


def load_example(path: str) -> ModuleType:
    """``scripts/train.py`` as a module (``TinyGPT``, ``make_batch``), without running its ``main``."""
    spec = importlib.util.spec_from_file_location("deepspeed_xla_example_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
