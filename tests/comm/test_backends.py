"""Registering the backends: what a registered backend's process does at exit."""
from tests.multiproc import free_port, run_python

_SCRIPT = """
import atexit
import torch.distributed as dist
from deepspeed_xla.comm import backends
atexit.register(lambda: print("groups at the interpreter's end:", dist.is_initialized()))  # runs after the others
dist.init_process_group(backends.register_backend("xla_host", host_addressable=True),
                        init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
dist.new_group(backend="gloo")
print("groups at the script's end:", dist.is_initialized())
"""


def test_a_script_that_leaves_its_groups_has_them_destroyed_before_the_interpreter_ends():
    """Left to the interpreter's finalization, a gloo group's threads can abort the finished process."""
    proc = run_python(_SCRIPT.format(port=free_port()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("groups at")]  # gloo prints too
    assert said == ["groups at the script's end: True", "groups at the interpreter's end: False"]
