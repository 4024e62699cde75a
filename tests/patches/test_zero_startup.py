"""``patches/zero_startup.py``: ZeRO-3's move of its partitions into one flat buffer, in one execution."""
import torch

from deepspeed_xla import patches, xla_runtime
from deepspeed_xla.patches import zero_startup


def test_defragment_builds_upstreams_buffer_in_one_execution(xla_device):
    """Pending partitions of different shapes (each a graph of its own upstream) become the buffer upstream builds
    from the same values on the CPU, each tensor a span of it, with one compilation and one execution."""
    import deepspeed.runtime.zero.stage3 as stage3
    from deepspeed.runtime.zero import utils
    (patch,) = [p for p in patches.PATCHES if p.wrapper is zero_startup.defragment_at_once]
    assert patches.is_applied(patch) and stage3.defragment.__wrapped__ is utils.defragment
    sources = [torch.randn(n) for n in (5, 7, 11)]
    expected_tensors = [source * 2 for source in sources]
    expected = utils.defragment(expected_tensors)
    tensors = [source.to(xla_device) * 2 for source in sources]  # pending: not executed yet
    before = xla_runtime.graph_counters()
    buffer = stage3.defragment(tensors)
    after = xla_runtime.graph_counters()
    assert {key: after[key] - before[key] for key in ("compilations", "executions")} == {"compilations": 1,
                                                                                         "executions": 1}
    assert torch.equal(buffer.cpu(), expected)
    buffer.add_(1)  # each tensor is a view of its span, as upstream's are
    for tensor, source in zip(tensors, sources):
        assert torch.equal(tensor.cpu(), source * 2 + 1)


def _tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def ranks_take_rank_0s_weights() -> None:
    """Run by ``run_ranks`` on 2 ranks, each building the model from a seed of its own: after ``deepspeed.initialize``
    (ZeRO-0, fp32 and bf16, and ZeRO-3, which broadcasts again as it partitions) every rank holds rank 0's weights."""
    import deepspeed
    deepspeed.init_distributed()
    rank = deepspeed.comm.get_rank()
    for stage, bf16 in ((0, False), (0, True), (3, False)):
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
        net = _tiny(rank)
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            held = [param.detach().float().cpu() for param in params]
        expected = [param.detach().to(params[0].dtype).float() for param in _tiny(0).parameters()]
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(held, expected)), (rank, stage, bf16)
        engine.destroy()


def test_engine_and_zero3_broadcast_rank_0s_weights():
    from tests.multiproc import run_ranks
    for proc in run_ranks(f"{__name__}:ranks_take_rank_0s_weights", 2, env={"DS_ACCELERATOR": "xla"}, timeout=300):
        assert proc.returncode == 0, proc.stderr[-4000:]
