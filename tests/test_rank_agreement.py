"""What the ranks of a job must agree on, and how a disagreement is named (the launched check:
tests/launched/test_bad_input.py)."""
import pytest

from deepspeed_xla import rank_agreement


def test_config_values_leave_out_per_rank_files_and_objects():
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local/rank3"}},
              "tensorboard": {"enabled": True, "output_path": "tb/rank3", "job_name": "run"},
              "flops_profiler": {"output_file": "flops.rank3", "profile_step": 2},
              "checkpoint": {"load_universal": False},
              "tensor_parallel": {"tp": {"tp_group": object()}}, "betas": [0.9, 0.95],
              "schedule": [{"step": 1}, {"step": 2}]}
    assert rank_agreement.config_values(config) == {
        "zero_optimization.stage": 3, "zero_optimization.offload_param.device": "nvme",
        "tensorboard.enabled": True, "tensorboard.job_name": "run", "flops_profiler.profile_step": 2,
        "checkpoint.load_universal": False,
        "betas": [0.9, 0.95], "schedule[0].step": 1, "schedule[1].step": 2}


def _state(config: dict, environ=None, **versions) -> dict:
    return {"config": rank_agreement.config_values(config),
            "versions": {**dict.fromkeys(rank_agreement.DISTRIBUTIONS, "1.0"), **versions},
            "environment": rank_agreement.switches(environ or {})}


def test_disagreements_name_the_odd_ranks_and_every_value():
    states = [_state({"gradient_clipping": 1.0}), _state({"gradient_clipping": 1.0}),
              _state({"gradient_clipping": 0.5}, deepspeed="2.0"), _state({})]
    assert rank_agreement.disagreements(states) == [
        'version of deepspeed: "2.0" on rank 2 (the others: "1.0" on ranks 0, 1, 3)',
        "config 'gradient_clipping': 0.5 on rank 2; \"<not set>\" on rank 3 (the others: 1.0 on ranks 0, 1)"]


def test_check_gathers_digests_and_states_only_when_they_differ():
    """One collective when the ranks agree; the second one, and the error, on every rank when they do not."""
    def gather(theirs):
        calls = []

        def all_gather_object(object_list, obj):
            calls.append(obj)
            object_list[:] = [obj, theirs if isinstance(obj, dict) else rank_agreement._digest(theirs)]

        return calls, all_gather_object

    config = {"train_micro_batch_size_per_gpu": 2}
    calls, same = gather(rank_agreement.rank_state(config))
    rank_agreement.check(config, same, 2)
    assert len(calls) == 1 and isinstance(calls[0], str)
    calls, other = gather(rank_agreement.rank_state({"train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(RuntimeError, match=r"'train_micro_batch_size_per_gpu': 4 on rank 1 \(the others: 2 on rank 0"):
        rank_agreement.check(config, other, 2)
    assert len(calls) == 2


def test_checkpoint_on_sigterm_set_on_some_hosts_only_is_named_on_every_rank(monkeypatch):
    """Its path may differ per host (local disks); whether it is set may not: the ranks that save on SIGTERM would
    wait in the save's collectives for the ranks that do not."""
    def gather(theirs):
        def all_gather_object(object_list, obj):
            object_list[:] = [obj, theirs if isinstance(obj, dict) else rank_agreement._digest(theirs)]
        return all_gather_object

    config = {"train_micro_batch_size_per_gpu": 2}
    monkeypatch.setenv("DS_XLA_CHECKPOINT_ON_SIGTERM", "/local/ckpt")
    monkeypatch.delenv("DS_XLA_CHECKPOINT_ON_SIGTERM")
    unset = rank_agreement.rank_state(config)
    with monkeypatch.context() as patched:
        patched.setenv("DS_XLA_CHECKPOINT_ON_SIGTERM", "/other/host/ckpt")
        rank_agreement.check(config, gather(rank_agreement.rank_state(config)), 2)  # other paths: agreed
        with pytest.raises(RuntimeError) as raised:
            rank_agreement.check(config, gather(unset), 2)
    assert str(raised.value).endswith(
        "environment variable DS_XLA_CHECKPOINT_ON_SIGTERM: \"not set\" on rank 1 (the others: \"set\" on rank 0). "
        "Every rank must run the same DeepSpeed config and the same torch, torch_xla, deepspeed and deepspeed_xla: "
        "give every host the same config file and environment (docs/bad_input.md); set DS_XLA_CHECKPOINT_ON_SIGTERM "
        "on every host (in .deepspeed_env, which the runner hands every host) or on none.")
