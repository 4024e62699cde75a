"""DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get_*``/``safe_set_*``) on 2 XLA ranks, against
DeepSpeed's own CPU accelerator.

One 2-rank launch per accelerator runs every configuration (ZeRO 1-3 × fp32/bf16 × with and without CPU
offload) in turn on a tiny model: every getter, full and local, on every parameter after a backward; every
setter followed by a read-back, a step, and the values and loss after it. Each rank writes what
it saw (values, or the error a call raised) as JSON, and ``test_fragment_api[<config>]`` compares the XLA
run's record with the CPU run's, key by key.
"""
import math
from typing import Callable, Dict, Optional

import pytest
import torch

from tests.multiproc import record_cases, records_on_both_accelerators

WORLD = 2
MOMENTS = ("exp_avg", "exp_avg_sq")
# Of max(1, |value|). bf16: both sides compute the gradients in bf16, in their own order, so after a bf16 step they
# differ by a few bf16 steps of the gradient (measured: 1.5e-3, 3 of them, on gradients of ~0.1).
TOLERANCE = {"fp32": 1e-6, "bf16": 4e-3}
CONFIGS = [f"zero{stage}-{precision}{offload}" for stage in (1, 2, 3) for precision in TOLERANCE
           for offload in ("", "-offload")]
OUT_ENV = "DSX_TEST_FRAGMENT_OUT"


def ds_config(name: str) -> dict:
    stage = int(name[4])
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned, gathered and released
    if name.endswith("-offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": zero, "bf16": {"enabled": "-bf16" in name}, "steps_per_print": 1000}


def tiny_model() -> torch.nn.Module:
    """ZeRO-1/2's partitions split ``out.weight`` between the ranks. Every size is even: ZeRO-3's full setters
    narrow the unpadded value at the padded partition's offset (DeepSpeed 0.19.8 raises on one rank for odd
    sizes, and the other waits in the next collective)."""

    class Tiny(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.out = torch.nn.Linear(8, 16)

        def forward(self, tokens, targets):
            logits = self.out(torch.tanh(self.embed(tokens))).float()
            return torch.nn.functional.cross_entropy(logits.view(-1, 16), targets.view(-1))

    torch.manual_seed(0)
    return Tiny()


def pattern(shape, salt: float) -> torch.Tensor:
    """A deterministic fp32 value for a setter, the same on every rank and accelerator."""
    return (torch.linspace(-1.0, 1.0, math.prod(shape)) * (0.1 + 0.01 * salt)).reshape(shape)


def as_record(value):
    if torch.is_tensor(value):
        return {"dtype": str(value.dtype), "shape": list(value.shape), "values": value.float().flatten().tolist()}
    return value


class Recorder:
    """Every call's result or error, keyed by step, call and parameter. Results are kept as device copies
    (a local getter returns a view of state the next step changes) and read together in ``flush``: one XLA
    execution for all of them, not one per result."""

    def __init__(self):
        self.records: Dict[str, object] = {}
        self.pending: Dict[str, object] = {}

    def __call__(self, key: str, call: Callable, *args) -> None:
        try:
            value = call(*args)
            self.pending[key] = value.detach().clone() if torch.is_tensor(value) else value
        except Exception as error:  # the same call must fail the same way on both accelerators
            self.records[key] = {"error": f"{type(error).__name__}: {error}"}

    def flush(self) -> None:
        from deepspeed.accelerator import get_accelerator
        get_accelerator().synchronize()
        self.records.update((key, as_record(value.cpu() if torch.is_tensor(value) else value))
                            for key, value in self.pending.items())
        self.pending.clear()


def exercise(name: str) -> dict:
    """Train the tiny model with ``name``'s config: a plain step; the full setters; the local setters and the
    vectorized update. Every getter runs after the first step's backward, after each set and after each step."""
    import deepspeed
    from deepspeed import utils as ds

    engine, *_ = deepspeed.initialize(model=tiny_model(), config=ds_config(name))
    rank = engine.global_rank
    named = list(engine.module.named_parameters())
    record = Recorder()

    def value(shape, salt: float, key: Optional[str] = None):
        """A setter's value on the device; the second moment must stay positive."""
        data = pattern(shape, salt)
        return (data.abs() if key == "exp_avg_sq" else data).to(engine.device)

    def read(point: str, grads: bool = True):
        """Gradients exist only from backward to step: outside that, ZeRO-1/2 raise on the ranks that hold a
        fragment of the parameter while the others wait in its collective."""
        for pname, param in named:
            record(f"{point}/full_fp32_param/{pname}", ds.safe_get_full_fp32_param, param)
            record(f"{point}/local_fp32_param/{pname}", ds.safe_get_local_fp32_param, param)
            if grads:
                record(f"{point}/full_grad/{pname}", ds.safe_get_full_grad, param)
                record(f"{point}/local_grad/{pname}", ds.safe_get_local_grad, param)
            for key in MOMENTS:
                record(f"{point}/full_{key}/{pname}", ds.safe_get_full_optimizer_state, param, key)
                record(f"{point}/local_{key}/{pname}", ds.safe_get_local_optimizer_state, param, key)
        record.flush()

    def set_full():
        for salt, (pname, param) in enumerate(named):
            shape = getattr(param, "ds_shape", param.shape)
            record(f"set_full_grad/{pname}", ds.safe_set_full_grad, param, value(shape, salt))
            record(f"set_full_fp32_param/{pname}", ds.safe_set_full_fp32_param, param, value(shape, salt + 1))
            for i, key in enumerate(MOMENTS):
                record(f"set_full_{key}/{pname}", ds.safe_set_full_optimizer_state, param,
                       value(shape, salt + 2 + i, key), key)

    def set_local():
        for salt, (pname, param) in enumerate(named):
            shape, mine = getattr(param, "ds_tensor", param).shape, salt + 10 * rank  # ZeRO-3: this rank's partition
            record(f"set_local_grad/{pname}", ds.safe_set_local_grad, param, value(shape, mine))
            record(f"set_local_fp32_param/{pname}", ds.safe_set_local_fp32_param, param, value(shape, mine + 1))
            for i, key in enumerate(MOMENTS):
                record(f"set_local_{key}/{pname}", ds.safe_set_local_optimizer_state, param,
                       value(shape, mine + 2 + i, key), key)
        record("update_full_grad_vectorized", ds.safe_update_full_grad_vectorized, [p for _, p in named],
               lambda grad, param: grad * 2 + 0.01)

    gen = torch.Generator().manual_seed(rank)
    for step, setters in enumerate((None, set_full, set_local)):
        tokens, targets = (torch.randint(0, 16, (4, 6), generator=gen).to(engine.device) for _ in range(2))
        loss = engine(tokens, targets)
        engine.backward(loss)
        record.records[f"{step}/loss"] = loss.item()
        if setters:
            if step == 1:
                read(f"{step}/after_backward")
            setters()
            read(f"{step}/after_set")
        engine.step()
        if setters:
            read(f"{step}/after_step", grads=False)
    return record.records


def rank_main() -> None:
    """One rank: every configuration in turn."""
    record_cases(CONFIGS, exercise, OUT_ENV)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(xla, cpu)``: each a list of per-rank records, the two launches run concurrently."""
    return records_on_both_accelerators(f"{__name__}:rank_main", WORLD, tmp_path_factory.mktemp("fragment"), OUT_ENV)


def differences(xla: dict, cpu: dict, tolerance: float) -> list:
    """Keys whose XLA record is not the CPU one: a different error, dtype, shape, or values beyond ``tolerance``."""
    found = []
    for key in sorted(set(xla) | set(cpu)):
        got, want = xla.get(key, "<missing>"), cpu.get(key, "<missing>")
        if isinstance(want, dict) and "values" in want and isinstance(got, dict) and "values" in got:
            if (got["dtype"], got["shape"]) != (want["dtype"], want["shape"]):
                found.append(f"{key}: {got['dtype']}{got['shape']} != {want['dtype']}{want['shape']}")
            elif any(abs(a - b) > tolerance * max(1.0, abs(b)) for a, b in zip(got["values"], want["values"])):
                worst = max(abs(a - b) for a, b in zip(got["values"], want["values"]))
                found.append(f"{key}: values differ by up to {worst:.3g}")
        elif isinstance(want, float) and isinstance(got, float):
            if abs(got - want) > tolerance * max(1.0, abs(want)):
                found.append(f"{key}: {got} != {want}")
        elif got != want:
            found.append(f"{key}: {str(got)[:300]} != {str(want)[:300]}")
    return found


@pytest.mark.parametrize("config", CONFIGS)
def test_fragment_api(runs, config):
    xla, cpu = runs
    for rank in range(WORLD):
        assert (xla[rank]["accelerator"], cpu[rank]["accelerator"]) == ("xla", "cpu"), rank
        assert "failed" not in cpu[rank][config], f"CPU accelerator, rank {rank}:\n{cpu[rank][config]['failed']}"
        assert "failed" not in xla[rank][config], f"XLA, rank {rank}:\n{xla[rank][config]['failed']}"
        found = differences(xla[rank][config], cpu[rank][config], TOLERANCE[config.split("-")[1]])
        assert not found, f"rank {rank}: {len(found)} differences:\n" + "\n".join(found[:40])
        # Not the same failure on both sides: only the local forms, which are ZeRO-3's alone, may raise.
        raised = [key for key, got in xla[rank][config].items() if isinstance(got, dict) and "error" in got]
        assert all("local" in key for key in raised) and not (raised and config.startswith("zero3")), raised
