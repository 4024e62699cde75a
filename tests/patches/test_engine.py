"""``patches/engine.py``: the engine moves the user's Parameters and fits ZeRO's buffers to XLA."""
import pytest
import torch

from deepspeed_xla import patches


def test_keep_parameter_objects_preserves_identity():
    import torch_xla
    model = torch.nn.Linear(3, 2)
    before = list(model.parameters())
    with patches.engine.keep_parameter_objects():
        model.to(torch_xla.device())
    assert all(a is b for a, b in zip(before, model.parameters()))
    assert model.weight.device.type == "xla"


def test_the_move_keeps_parameter_attributes():
    """Swapping a Parameter's contents swaps its ``__dict__``: the marks DeepSpeed reads after the move (MoE's
    ``allreduce``/``group_name``) are put back on the same objects, now on the device."""
    import torch_xla
    from types import SimpleNamespace
    model = torch.nn.Linear(3, 2)
    model.weight.allreduce, model.weight.group_name = False, "ep_size_2"

    def move(self, module):
        module.to(torch_xla.device())

    patches.engine.configure_distributed_model(move)(SimpleNamespace(), model)
    assert model.weight.device.type == "xla"
    assert (model.weight.allreduce, model.weight.group_name) == (False, "ep_size_2")
    assert not hasattr(model.bias, "allreduce")


def _configure_zero(zero_config: dict, module=None, has_moe_layers=False):
    """Run the ``_configure_zero_optimizer`` patch on an engine stand-in; returns DeepSpeed's parsed ZeRO config."""
    from types import SimpleNamespace
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    zero = DeepSpeedZeroConfig(**zero_config)
    engine = SimpleNamespace(module=module or torch.nn.Linear(8, 1), has_moe_layers=has_moe_layers,
                             _config=SimpleNamespace(zero_config=zero))
    patches.engine.configure_zero_optimizer(lambda self, optimizer: None)(engine, None)
    return zero


def test_capped_bucket_sizes_stay_even():
    """ZeRO-1/2 assert an even all-gather bucket: a model with an odd parameter count (9) gets 10, not 9."""
    zero = _configure_zero({"stage": 2})
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == zero.prefetch_bucket_size == 10


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_contiguous_gradients_off_unless_the_config_sets_it(stage):
    assert _configure_zero({"stage": stage}).contiguous_gradients is False
    assert _configure_zero({"stage": stage, "contiguous_gradients": True}).contiguous_gradients is True
    assert _configure_zero({"stage": stage}, has_moe_layers=True).contiguous_gradients is True  # ZeRO-2 MoE needs it


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_zero_init_model_needs_zero_3(stage):
    """A model whose parameters ``zero.Init`` partitioned (``ds_id``) is refused below ZeRO-3, naming both ways out;
    at ZeRO-3, and for a model built outside ``zero.Init``, the engine's own method runs."""
    from types import SimpleNamespace
    engine = SimpleNamespace(zero_optimization_stage=lambda: stage,
                             zero_optimization_partition_weights=lambda: stage == 3)
    configure = patches.engine.refuse_partitioned_model_below_stage_3(lambda self, model: "configured")
    plain, built_partitioned = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    built_partitioned.weight.ds_id = 0
    assert configure(engine, plain) == "configured"
    if stage == 3:
        assert configure(engine, built_partitioned) == "configured"
    else:
        with pytest.raises(ValueError, match=rf"inside deepspeed.zero.Init \(1 partitioned parameter\(s\), e.g. "
                                             rf"weight\), but zero_optimization.stage is {stage}: .*Set \"stage\": 3, "
                                             "or build the model outside deepspeed.zero.Init"):
            configure(engine, built_partitioned)
