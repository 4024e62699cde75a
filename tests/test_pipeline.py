"""DeepSpeed's pipeline engine on XLA (``PipelineModule`` + ``train_batch``), against the CPU accelerator.

The model ties its embedding between the first and last stage; 4 micro-batches per step. On PJRT CPU
activations and gradients move through ``xla_host``; the TPU transfer path (``xla_ds``) is tested in
``tests/comm/test_xla_collectives.py``.
"""
import json
from pathlib import Path

import pytest

from tests.multiproc import ds_config, max_abs_diff, run_against_cpu

TIED = "tied_modules.embed.tok.weight"


def _rank_result(workdir: Path, rank: int) -> dict:
    path = workdir / "xla" / "xla-losses.json"
    return json.loads((path if rank == 0 else Path(f"{path}.rank{rank}")).read_text())


def _pipe_config(bf16=False, stage=0):
    return ds_config(stage, bf16=bf16, micro_batch=2, accumulation=4)


def _assert_no_compilation_after_warmup(result: dict) -> None:
    counters = result["counters"]
    assert counters["end"]["compilations"] == counters["warm"]["compilations"], counters


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_two_stage_pipeline_matches_cpu_accelerator(tmp_path, bf16):
    xla, cpu = run_against_cpu(tmp_path, _pipe_config(bf16), num_procs=2, steps=4 if bf16 else 5,
                               train_args=("--pipeline-stages", "2"))
    assert max_abs_diff(xla["losses"], cpu["losses"]) <= (2e-2 if bf16 else 1e-4)
    last = _rank_result(tmp_path, 1)
    assert xla["params"][TIED] == last["params"][TIED], "tied embedding differs between first and last stage"
    for result in (xla, last):
        _assert_no_compilation_after_warmup(result)


def test_pipe_2_by_data_2_with_zero_1_on_four_ranks(tmp_path):
    xla, cpu = run_against_cpu(tmp_path, _pipe_config(stage=1), num_procs=4, steps=4,
                               train_args=("--pipeline-stages", "2"), extra_env={"CPU_NUM_DEVICES": 4})
    assert max_abs_diff(xla["losses"], cpu["losses"]) <= 1e-4
    results = [_rank_result(tmp_path, rank) for rank in range(4)]
    tied = [r["params"][TIED] for r in results]
    assert all(t == tied[0] for t in tied), "tied embedding differs between stages or data-parallel replicas"


def test_four_stages_with_activation_checkpointing(tmp_path):
    """Tied weights on stages 0 and 3: their gradient all-reduce runs in a group that does not tile the world."""
    xla, cpu = run_against_cpu(tmp_path, _pipe_config(), num_procs=4, steps=4, extra_env={"CPU_NUM_DEVICES": 4},
                               train_args=("--pipeline-stages", "4", "--activation-checkpoint-interval", "1"))
    assert max_abs_diff(xla["losses"], cpu["losses"]) <= 1e-4
    first, last = _rank_result(tmp_path, 0), _rank_result(tmp_path, 3)
    assert first["params"][TIED] == last["params"][TIED], "tied embedding differs between stage 0 and stage 3"
    _assert_no_compilation_after_warmup(first)
