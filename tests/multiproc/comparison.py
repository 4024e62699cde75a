"""How close a run on XLA must come to the same run on DeepSpeed's CPU accelerator, and the assertions that compare
two runs' losses and final weights."""
import math
from typing import List, Optional, Tuple

from tests.multiproc.launching import ranks

# How close a run on XLA must come to the same run on DeepSpeed's CPU accelerator. Losses: fp32 absolute (they are
# ~1-4); bf16 relative to the CPU run's value, since a bf16 number is only as exact as a fraction of itself. Final
# weights, element by element: fp32 runs differ by float32 round-off (measured: at most 1.4e-6); bf16 runs by a
# bf16 step of a weight (1/128 of it: 7.8e-3 for LayerNorm's ~1.0) and, on weights with small gradients, by the
# few Adam steps (lr 3e-3 each) their bf16 gradients' rounding turned the other way (measured: at most 5e-3).
LOSS_TOLERANCE = {"float32": {"atol": 1e-4, "rtol": 0.0}, "bfloat16": {"atol": 0.0, "rtol": 5e-3}}
PARAM_TOLERANCE = {"float32": {"atol": 1e-5, "rtol": 1e-4}, "bfloat16": {"atol": 1.5e-2, "rtol": 1 / 64}}
# The key biases (the middle third of each ``qkv.bias`` in scripts/train.py's model) get no gradient: the softmax
# ignores a constant added to every key, so theirs is round-off, which Adam scales up to full steps of lr in
# arbitrary directions. Two implementations disagree there by up to 2 x lr x steps (train.py: 3e-3, <= 20 steps).
KEY_BIAS_ATOL = 2 * 3e-3 * 20 + 1e-3


def training_dtype(config: dict) -> str:
    """The dtype a DeepSpeed config trains the model's weights in."""
    return "bfloat16" if config.get("bf16", {}).get("enabled") else "float32"


def within(actual, expected, atol: float, rtol: float) -> bool:
    """|actual - expected| <= atol + rtol * |expected|, element by element (numbers or nested lists)."""
    import torch
    actual, expected = torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    return actual.shape == expected.shape and bool(((actual - expected).abs() <= atol + rtol * expected.abs()).all())


def assert_trains_like(xla: dict, cpu: dict, dtype: str, loss_tolerance: Optional[dict] = None) -> None:
    """``xla`` and ``cpu`` (``run_training`` results of one training) agree: rank 0's per-step losses, and every
    rank's final weights, which both hold in ``dtype`` (the module's weights DeepSpeed trains, not fp32 masters)."""
    assert (xla["accelerator"], cpu["accelerator"]) == ("xla", "cpu")
    assert xla["world_size"] == cpu["world_size"] and xla["first_step"] == cpu["first_step"]
    assert len(xla["losses"]) == len(cpu["losses"]) > 0 and all(map(math.isfinite, xla["losses"])), xla["losses"]
    tolerance = loss_tolerance or LOSS_TOLERANCE[dtype]
    assert within(xla["losses"], cpu["losses"], **tolerance), (
        f"losses differ beyond {tolerance}:\nxla {xla['losses']}\ncpu {cpu['losses']}")
    assert_weights_like(xla, cpu, dtype)


def assert_weights_like(xla: dict, cpu: dict, dtype: str, key_bias: Tuple[str, float] = ("qkv.bias", KEY_BIAS_ATOL)
                        ) -> None:
    """Every rank's final weights in ``xla`` and ``cpu`` agree within ``PARAM_TOLERANCE``, both held in ``dtype``;
    ``key_bias``: the name ending of the model's query-key-value bias and the tolerance of its key third."""
    import torch
    suffix, key_bias_atol = key_bias
    for mine, theirs in zip(ranks(xla), ranks(cpu), strict=True):
        rank = mine["rank"]
        assert mine["params"].keys() == theirs["params"].keys() != set(), rank
        assert set(mine["param_dtypes"].values()) == set(theirs["param_dtypes"].values()) == {dtype}, (
            rank, mine["param_dtypes"], theirs["param_dtypes"])
        for name, values in mine["params"].items():
            values, expected = torch.tensor(values, dtype=torch.float64), torch.tensor(theirs["params"][name],
                                                                                        dtype=torch.float64)
            if dtype == "bfloat16":  # the JSON holds floats: they must be bf16 numbers
                assert torch.equal(values.bfloat16().double(), values), f"rank {rank}: {name} is not bf16"
            assert values.shape == expected.shape, (rank, name)
            atol = torch.full_like(expected, PARAM_TOLERANCE[dtype]["atol"])
            if name.endswith(suffix):
                third = len(expected) // 3
                atol[third:2 * third] = key_bias_atol
            differs = (values - expected).abs() > atol + PARAM_TOLERANCE[dtype]["rtol"] * expected.abs()
            assert not differs.any(), (f"rank {rank}: {name} differs at {differs.nonzero().flatten().tolist()[:5]}: "
                                       f"{values[differs].tolist()[:5]} vs {expected[differs].tolist()[:5]}")


def trained_alike(xla: list, cpu: list, case: str) -> List[Tuple[dict, dict]]:
    """Each rank's ``(xla, cpu)`` records of ``case`` (``records_on_both_accelerators``), once both trained it without
    failing, with the same per-step losses and final weights (fp32)."""
    pairs = []
    for rank, (mine, theirs) in enumerate(zip(xla, cpu, strict=True)):
        assert (mine["accelerator"], theirs["accelerator"]) == ("xla", "cpu"), rank
        mine, theirs = mine[case], theirs[case]
        assert "failed" not in theirs, f"CPU accelerator, rank {rank}:\n{theirs['failed']}"
        assert "failed" not in mine, f"XLA, rank {rank}:\n{mine['failed']}"
        assert within(mine["losses"], theirs["losses"], **LOSS_TOLERANCE["float32"]), (
            rank, mine["losses"], theirs["losses"])
        assert mine["params"].keys() == theirs["params"].keys() != set()
        for name, values in mine["params"].items():
            assert within(values, theirs["params"][name], **PARAM_TOLERANCE["float32"]), (rank, name)
        pairs.append((mine, theirs))
    return pairs
