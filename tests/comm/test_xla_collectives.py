"""The ``xla_ds`` backend (TPU): the pieces PJRT CPU can run.

PJRT CPU has no cross-process XLA collectives, so the multi-rank behaviour of this backend is only
exercised on TPU. Here: the uneven all-to-all padding round trip, and a 1-rank world on a real XLA
device running every overridden op (object collectives on CPU tensors, barrier, coalesced all-reduce,
all-to-all with split sizes).
"""
import torch

from deepspeed_xla.comm.xla_collectives import pad_chunks, unpad_chunks
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

    from deepspeed_xla.comm import xla_collectives
    xla_collectives.register()
    dist.init_process_group(xla_collectives.BACKEND_NAME)
    assert dist.get_backend() == xla_collectives.BACKEND_NAME
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
    dist.destroy_process_group()


def test_overridden_ops_on_one_rank():
    (result, ) = run_ranks("tests.comm.test_xla_collectives:one_rank_main", 1)
    assert result.returncode == 0, result.stderr[-4000:]
