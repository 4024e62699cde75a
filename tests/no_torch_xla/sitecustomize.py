"""Test-only: a Python without torch_xla. Put this folder on PYTHONPATH: importing torch_xla raises ImportError."""
import sys


class _NoTorchXla:

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torch_xla" or fullname.startswith("torch_xla."):
            raise ImportError(f"{fullname} is not importable in this process (tests/no_torch_xla)")
        return None


sys.meta_path.insert(0, _NoTorchXla())
