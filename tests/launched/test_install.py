"""``pip install .`` and ``pip install -e .`` both put the startup hook where every interpreter runs it.

Each install goes into a fresh, pip-less venv whose only other path is this venv's site-packages
(added as a plain path entry, so that venv's own ``.pth`` files, ours included, are not processed).
"""
import json
import site
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env
from tests.multiproc import run_command


@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_install_registers_hook(tmp_path, editable):
    target = tmp_path / "venv"
    venv.create(target, with_pip=False)
    python = target / "bin" / "python"
    purelib = run_command([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          60).stdout.strip()
    with open(f"{purelib}/_host_packages.pth", "w") as handle:
        handle.write("\n".join(site.getsitepackages()) + "\n")
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
           *(["-e"] if editable else []), str(REPO)]
    env = clean_env()
    install = run_command(cmd, 300, env=env)
    assert install.returncode == 0, install.stderr
    probe = ("import json, deepspeed, deepspeed_xla\n"
             "from deepspeed.accelerator import get_accelerator\n"
             "print(json.dumps([get_accelerator().device_name(), deepspeed_xla.__file__]))")
    proc = run_command([str(python), "-c", probe], 300, env=clean_env(DS_ACCELERATOR="xla"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, location = json.loads(proc.stdout.strip().splitlines()[-1])
    assert name == "xla"
    assert (Path(purelib) / "deepspeed_xla.pth").is_file()
    if editable:  # the host venv's copy shadows the editable finder here; check where the finder points
        finder = next(Path(purelib).glob("__editable___deepspeed_xla*_finder.py")).read_text()
        assert str(REPO / "deepspeed_xla") in finder
    else:
        assert location.startswith(str(target)), location
