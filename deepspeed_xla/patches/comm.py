"""Patches of DeepSpeed's comm layer (``deepspeed.comm.torch``): the DeviceMesh it builds for its groups.

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
