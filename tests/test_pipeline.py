"""DeepSpeed's pipeline engine on XLA (``PipelineModule`` + ``train_batch``), against the CPU accelerator.

The model ties its embedding between the first and last stage; 4 micro-batches per step.
"""
import json
from pathlib import Path

import pytest

from tests.multiproc import ds_config, max_abs_diff, run_against_cpu

TIED = "tied_modules.embed.tok.weight"


def _rank_result(workdir: Path, rank: int) -> dict:
    path = workdir / "xla" / "xla-losses.json"
    return json.loads((path if rank == 0 else Path(f"{path}.rank{rank}")).read_text())


def _pipe_config(bf16=False):
    return ds_config(0, bf16=bf16, micro_batch=2, accumulation=4)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_two_stage_pipeline_matches_cpu_accelerator(tmp_path, bf16):
    xla, cpu = run_against_cpu(tmp_path, _pipe_config(bf16), num_procs=2, steps=4 if bf16 else 5,
                               train_args=("--pipeline-stages", "2"))
    assert max_abs_diff(xla["losses"], cpu["losses"]) <= (2e-2 if bf16 else 1e-4)
    last = _rank_result(tmp_path, 1)
    assert xla["params"][TIED] == last["params"][TIED], "tied embedding differs between first and last stage"
    if not bf16:  # bf16 compiles one more graph at step 3 or 4, once (see the issue notes)
        counters = xla["counters"]
        assert counters["end"]["compilations"] == counters["warm"]["compilations"], counters


def test_pipe_2_by_data_2_on_four_ranks(tmp_path):
    config = _pipe_config()
    xla, cpu = run_against_cpu(tmp_path, config, num_procs=4, steps=4, train_args=("--pipeline-stages", "2"),
                               extra_env={"CPU_NUM_DEVICES": 4})
    assert max_abs_diff(xla["losses"], cpu["losses"]) <= 1e-4
    stage_of = {rank: _rank_result(tmp_path, rank) for rank in range(4)}
    tied = [r["params"][TIED] for r in stage_of.values()]
    assert all(t == tied[0] for t in tied)


def test_activation_checkpointing_in_pipeline(tmp_path):
    xla, cpu = run_against_cpu(tmp_path, _pipe_config(), num_procs=2, steps=4,
                               train_args=("--pipeline-stages", "2", "--activation-checkpoint-interval", "1"))
    assert max_abs_diff(xla["losses"], cpu["losses"]) <= 1e-4
