"""The ``xla_ds`` backend (TPU): its pieces, and ranks as processes.

PJRT CPU has no cross-process XLA collectives: the collectives across devices run in
``test_xla_collectives_devices.py`` (a thread per device of one process). Here: the uneven all-to-all padding
round trip; the replica groups given to XLA for
DeepSpeed's topology groups, against torch_xla's own inference and DeepSpeed's own group lists; a
1-rank world on a real XLA device running every overridden op (object collectives on CPU tensors,
barrier, coalesced all-reduce, all-to-all with split sizes); and 4 ranks running what never uses XLA
collectives on this backend (pipeline send/recv, a subgroup that cannot tile the world).
"""
import pytest
import torch

from deepspeed_xla.comm.xla_collectives import pad_chunks, tiling_mesh, unpad_chunks
from tests.multiproc import run_ranks


def test_pad_and_unpad_uneven_splits():
    data = torch.arange(24, dtype=torch.float32).reshape(12, 2)
    splits = [5, 0, 7]
    padded = pad_chunks(data, splits, width=7)
    assert padded.shape == (3, 7, 2)
    assert torch.equal(padded[1], torch.zeros(7, 2))
    assert torch.equal(unpad_chunks(padded, splits), data)


def one_rank_main() -> None:
    import torch.distributed as dist
    import torch_xla

    from deepspeed_xla.comm import backends
    dist.init_process_group(backends.register_backend("xla_ds", host_addressable=True))
    assert dist.get_backend() == "xla_ds"
    device = torch_xla.device()
    dist.barrier()
    gathered = [None]
    dist.all_gather_object(gathered, {"tag": "global_step7"})
    assert gathered == [{"tag": "global_step7"}], gathered
    objects = ["latest", 3]
    dist.broadcast_object_list(objects, src=0)
    assert objects == ["latest", 3]
    flags = torch.tensor([1.0, 2.0])
    dist.all_reduce(flags)
    assert flags.tolist() == [1.0, 2.0]
    pair = [torch.ones(3, device=device), torch.full((2, ), 2.0, device=device)]
    dist.all_reduce_coalesced(pair)
    assert [t.cpu().tolist() for t in pair] == [[1.0] * 3, [2.0] * 2]
    source = torch.arange(5, dtype=torch.float32, device=device)
    out = torch.empty(5, device=device)
    dist.all_to_all_single(out, source, output_split_sizes=[5], input_split_sizes=[5])
    assert out.cpu().tolist() == list(range(5))
    from deepspeed_xla import xla_runtime
    before = xla_runtime.graph_counters()
    dist.all_to_all_single(out, source * 2)  # even splits (MoE, Ulysses): no width read back from the device
    assert xla_runtime.graph_counters()["transfers_to_host"] == before["transfers_to_host"]
    assert out.cpu().tolist() == [2.0 * i for i in range(5)]
    dist.destroy_process_group()


def test_overridden_ops_on_one_rank():
    (result, ) = run_ranks("tests.comm.test_xla_collectives:one_rank_main", 1)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("ranks,world", [([0, 1, 2, 3], 4), ([0, 1], 4), ([2, 3], 4), ([0, 2], 4),
                                         ([1, 3], 4), ([1, 5, 9], 12), ([4, 5, 6, 7], 8)])
def test_tiling_matches_torch_xla_for_two_dimensional_layouts(ranks, world):
    from torch_xla.distributed.xla_backend import _infer_mesh
    assert tiling_mesh(ranks, world) == _infer_mesh(ranks, world)


@pytest.mark.parametrize("pipe,model,data", [(2, 2, 2), (4, 1, 2), (2, 3, 2), (3, 2, 1)])
def test_tiling_of_every_deepspeed_topology_group_is_its_axis(pipe, model, data):
    """Each rank knows only its own group; the tiling it derives is every group of that axis."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    topo = PipeModelDataParallelTopology(num_pp=pipe, num_mp=model, num_dp=data)
    for axis in topo.get_axis_names():
        axis_groups = sorted(topo.get_axis_comm_lists(axis))
        for group in axis_groups:
            assert sorted(tiling_mesh(group, topo.world_size())) == axis_groups, (axis, group)


def test_a_group_given_out_of_order_tiles_in_the_order_torch_ranks_it():
    """torch's ``new_group`` sorts its ranks: group rank i is the i-th smallest global rank, so ``new_group([2, 0])``
    gathers rank 0's data first, and the replica group the mesh gives XLA lists its ranks in that order too."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        group_ranks = dist.get_process_group_ranks(dist.new_group([2, 0]))
    finally:
        dist.destroy_process_group()
    assert tiling_mesh([2, 0], 4)[0] == group_ranks == [0, 2]


def test_groups_that_cannot_tile_the_world_are_refused():
    assert tiling_mesh([0, 3], 4) is None  # first and last of 4 pipeline stages (tied weights)
    assert tiling_mesh([0, 1], 3) is None
    # translates that start at rank 0 would not hold the group itself
    assert tiling_mesh([1, 2], 4) is None
    assert tiling_mesh([3, 4], 8) is None
    assert tiling_mesh([1, 2, 3], 6) is None


def four_rank_main() -> None:
    import torch.distributed as dist
    import torch_xla

    from deepspeed_xla.comm import backends
    dist.init_process_group(backends.register_backend("xla_ds", host_addressable=True))
    rank, device = dist.get_rank(), torch_xla.device()
    pairs, ends = dist.new_group([0, 1]), dist.new_group([0, 3])
    if rank < 2:
        assert pairs._mesh == [[0, 1], [2, 3]], pairs._mesh
    if rank in (0, 3):
        assert ends._mesh is None
        grad = torch.full((4, ), float(rank + 1), device=device)
        dist.all_reduce(grad, group=ends)
        assert grad.device.type == "xla" and grad.cpu().tolist() == [5.0] * 4, grad
        dist.barrier(group=ends)
    # a pipeline tick: every stage sends its activation forward, then receives from behind
    activation = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3) * (rank + 1)
    if rank < 3:
        dist.send(activation, rank + 1)
    if rank > 0:
        received = torch.empty(2, 3, device=device)
        dist.recv(received, rank - 1)
        assert received.device.type == "xla"
        assert received.cpu().tolist() == (torch.arange(6.0).reshape(2, 3) * rank).tolist(), received
    # both directions at once, as pipeline gradients flow back while activations flow forward
    peer = rank ^ 1
    inbox = torch.empty(3, device=device)
    works = [dist.isend(torch.full((3, ), float(rank), device=device), peer), dist.irecv(inbox, peer)]
    for work in works:
        work.wait()
    assert inbox.cpu().tolist() == [float(peer)] * 3
    dist.destroy_process_group()


def test_send_recv_and_host_only_subgroups_on_four_ranks():
    results = run_ranks("tests.comm.test_xla_collectives:four_rank_main", 4)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stderr[-4000:]}"
