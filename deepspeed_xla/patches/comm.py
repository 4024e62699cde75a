"""Patches of DeepSpeed's comm layer: the DeviceMesh it builds for its groups (``deepspeed.comm.torch``), the
times its comms logger records (``deepspeed.comm.comm``), and the XLA tensors its object collectives unpickle
(torch's ``_rebuild_device_tensor_from_cpu_tensor``, applied when ``deepspeed.comm.torch`` loads).

DeepSpeed takes AutoTP's and sequence parallelism's groups from a torch DeviceMesh on the accelerator's
device type (``mesh.get_group``). torch builds no process groups for a DeviceMesh on ``xla`` (it leaves
XLA meshes to SPMD), so ``get_group`` raises "DeviceMesh process groups not initialized!".
"""
import functools


def init_device_mesh(original):
    """Build the mesh on ``cpu``: torch makes its groups with ``new_group`` and the default backend
    (``xla_host`` or ``xla_ds``), which take XLA tensors too. DeepSpeed uses the mesh only for its groups."""

    @functools.wraps(original)
    def init_device_mesh(self, mesh_shape, mesh_dim_names):
        from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
        return torch_init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_dim_names)

    return init_device_mesh


def each_op_timed_alone(original):
    """``deepspeed.comm.comm.timers``, which only the comms logger reads (``timed_op``), so that each logged latency is
    the op's own. Upstream reads the op's timer after each op with ``elapsed(reset=False)``, the sum of every earlier
    record of that op, and logs that sum as the op's latency, on every accelerator (the logged average grows with the
    run: 26 s for a 12 MB all-reduce after 60 steps on xla). Here a read gives the time since the previous one and
    drops the records it read. And a timer starts once the device finished what came before: ``timed_op`` waits for
    the device only after the op, so on XLA the op's time held the pending graph that computes its operands (a
    backward's, under ZeRO) and the collectives queued before it."""
    upstream = type(original)

    class OwnTimes(upstream):

        class Timer(upstream.Timer):

            def start(self):
                from deepspeed.accelerator import get_accelerator
                get_accelerator().synchronize()
                super().start()

            def elapsed(self, reset=True):
                return super().elapsed(reset=True)

    return OwnTimes()


def rebuilt_xla_tensor_is_a_leaf(original):
    """torch pickles an XLA tensor as ``tensor.cpu()`` and its ``requires_grad``, and unpickling moves that copy back
    and sets ``requires_grad``. The copy of a tensor that requires grad keeps its autograd history, so the tensor
    rebuilt from it is not a leaf and setting the flag raises ("you can only change requires_grad flags of leaf
    variables"): AutoTP's first forward broadcasts its inputs as objects to check them (``broadcast_object_list``),
    and the receiving ranks of each tensor-parallel group failed there while the others waited in the group's next
    collective. Rebuilt from the copy's data instead: a leaf, as a CPU or CUDA tensor unpickles."""

    @functools.wraps(original)
    def rebuild(data, dtype, device, requires_grad):
        return original(data.detach(), dtype, device, requires_grad)

    return rebuild
