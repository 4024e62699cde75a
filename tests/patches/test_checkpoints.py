"""``patches/checkpoints.py``: the ZeRO stage a checkpoint was saved with is read from either file format and either
form of DeepSpeed's ZeRO setting; the ranks' views of a checkpoint are named by rank and host. (Saves and loads through
real engines: tests/launched/test_checkpoint.py.)"""
import pytest
import torch

from deepspeed_xla.patches import checkpoints


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("zero, stage", [({"stage": 2}, 2), (True, 1), (False, 0), (None, 0)])
def test_the_saved_zero_stage_is_read_from_either_format_and_either_form(tmp_path, zipfile, zero, stage):
    """A legacy-format file (``"checkpoint_serialization": false``) cannot be memory-mapped; ``"zero_optimization":
    true`` is stage 1 to DeepSpeed: both made every resume fail here."""
    config = {"train_batch_size": 2} if zero is None else {"zero_optimization": zero}
    torch.save({"module": {"w": torch.ones(3)}, "ds_config": config}, tmp_path / "mp_rank_00_model_states.pt",
               _use_new_zipfile_serialization=zipfile)
    assert checkpoints._saved_zero_stage(str(tmp_path)) == stage
    assert checkpoints._saved_zero_stage(str(tmp_path / "elsewhere")) is None


def test_differing_views_are_named_by_rank_and_host():
    assert checkpoints._differing([("h0", "tag a"), ("h1", "tag a")]) == ""
    views = [("h0", "tag last"), ("h0", "tag last"), ("h1", "no `latest`"), ("h2", "no `latest`")]
    assert checkpoints._differing(views) == "ranks 0, 1 (host h0): tag last; ranks 2, 3 (host h1, h2): no `latest`"
