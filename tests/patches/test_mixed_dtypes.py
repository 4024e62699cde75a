"""``patches/mixed_dtypes.py`` and ``compile_errors.py`` through the engine: a float dtype mismatch raises where the
user's forward makes it, as on DeepSpeed's CPU accelerator; one torch_xla lowers without a check reaches XLA's
compiler and is named as a refused step graph."""
import traceback

import pytest
import torch

from deepspeed_xla.patches import mixed_dtypes

# The refused graph last: tensors pending in it (the process's too) cannot be used after it.
MIXED_CASES = ["bf16-batch", "fp32-batch-bf16-engine", "bf16-model-called-alone", "mixed-scatter-add"]
MIXED_OUT = "DSX_TEST_MIXED_DTYPES_OUT"


class ScatterLoss(torch.nn.Module):
    """A linear layer whose loss scatter-adds the bf16 output into a float32 buffer: an op torch_xla lowers without a
    dtype check (CPU refuses it: scatter(): Expected self.dtype to be equal to src.dtype)."""

    def __init__(self, mixed: bool):
        super().__init__()
        self.linear = torch.nn.Linear(10, 16)
        self.mixed = mixed

    def forward(self, x):
        out = self.linear(x)
        bins = torch.zeros(4, dtype=torch.float32 if self.mixed else out.dtype, device=out.device)
        return bins.scatter_add(0, torch.arange(16, device=out.device) % 4, out.sum(0)).pow(2).sum()


def _counters():
    """XLA's graph counters so far (None on DeepSpeed's CPU accelerator)."""
    import deepspeed
    if deepspeed.get_accelerator().device_name() != "xla":
        return None
    from deepspeed_xla import xla_runtime
    return xla_runtime.graph_counters()


def _train(case: str) -> dict:
    """One engine (ZeRO-2, bf16) and four steps of ``case``: where the first error was raised (``forward``,
    ``step``), its type and text, and whether this file's line is in its traceback; or, for a correct run, the graph
    counters around each forward."""
    import deepspeed
    torch.manual_seed(0)
    model = ScatterLoss(mixed=case == "mixed-scatter-add")
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    found, where = {"forward_counters": []}, "forward"
    try:
        for step in range(4):
            x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step)).to(engine.device)
            if case != "fp32-batch-bf16-engine":
                x = x.to(torch.bfloat16)
            where = "forward"
            if case == "bf16-model-called-alone":
                model.linear(x.float())
            before = _counters()
            loss = engine(x)
            found["forward_counters"].append([before, _counters()])
            where = "step"
            engine.backward(loss)
            engine.step()
    except Exception as error:
        frames = traceback.extract_tb(error.__traceback__)
        found.update(raised_at=where, type=type(error).__name__, text=str(error),
                     this_file=any(frame.filename == __file__ for frame in frames))
    return found


def mixed_rank() -> None:
    from tests.multiproc import record_cases
    record_cases(MIXED_CASES, _train, MIXED_OUT)


def test_dtype_mismatches_are_named_where_the_forward_makes_them(tmp_path):
    """A float32 batch into a bf16 engine, and a bf16 layer called alone with float32: both accelerators raise in the
    forward, at this file's line; xla's error names both dtypes and the fix. A mismatch only XLA's compiler sees
    (scatter_add): the CPU accelerator raises in the forward, xla at engine.step(), naming the step's graph and the
    cause. A correct bf16 run reads nothing from the device in its forwards and compiles nothing in step 3 (DeepSpeed's
    first two steps differ)."""
    from tests.multiproc import records_on_both_accelerators
    (xla, ), (cpu, ) = records_on_both_accelerators(f"{__name__}:mixed_rank", 1, tmp_path, MIXED_OUT)
    for case in ("fp32-batch-bf16-engine", "bf16-model-called-alone"):
        for found in (xla[case], cpu[case]):
            assert (found.get("raised_at"), found.get("this_file")) == ("forward", True), (case, found)
        assert "mat1 and mat2 must have the same dtype" in cpu[case]["text"]
        assert xla[case]["text"] == mixed_dtypes.MIXED.format(layer="Linear(10 -> 16)", input="float32",
                                                              weight="bfloat16"), xla[case]
    case = "mixed-scatter-add"
    assert cpu[case]["raised_at"] == "forward" and "dtype" in cpu[case]["text"], cpu[case]
    assert (xla[case]["raised_at"], xla[case]["type"]) == ("step", "GraphCompileError"), xla[case]
    assert xla[case]["text"].startswith("deepspeed_xla: XLA could not compile optimizer step 1's graph (its forward,"), \
        xla[case]
    assert "mixed precision is disallowed" in xla[case]["text"] and "XLA_IR_DEBUG=1" in xla[case]["text"]
    correct = xla["bf16-batch"]
    assert "raised_at" not in correct and "raised_at" not in cpu["bf16-batch"], (correct, cpu["bf16-batch"])
    for before, after in correct["forward_counters"]:
        assert (after["executions"], after["transfers_to_host"]) == (before["executions"],
                                                                     before["transfers_to_host"]), correct
    assert correct["forward_counters"][2][0]["compilations"] == correct["forward_counters"][3][0]["compilations"]


def test_autocast_lets_dtypes_differ():
    """Under autocast the layer casts both operands: a float32 input to a bf16 layer is not refused."""
    import torch_xla
    from deepspeed_xla.patches.registry import unwrapped
    layer = torch.nn.Linear(10, 16).to(torch_xla.device()).to(torch.bfloat16)
    forward = mixed_dtypes.linear_refuses_mixed_dtypes(unwrapped(torch.nn.Linear.forward))
    x = torch.randn(4, 10).to(torch_xla.device())
    with pytest.raises(RuntimeError, match="got a float32 input, but its weight is bfloat16"):
        forward(layer, x)
    with torch.autocast("xla", dtype=torch.bfloat16):
        assert forward(layer, x).dtype == torch.bfloat16
