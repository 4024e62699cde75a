"""The collectives DeepSpeed issues in small trainings, recorded on ``xla_host`` for ``test_xla_collectives_replay.py``
to replay on ``xla_ds`` across XLA devices.

    python -m tests.comm.record_collectives            # all of RUNS into tests/comm/recordings/ (a few minutes)
    python -m tests.comm.record_collectives zero2-2    # one of them

Each run is ``scripts/train.py`` (a tiny TinyGPT, 2 steps) through the ``deepspeed`` launcher; every rank wraps the
ProcessGroup methods of its ``xla_host`` groups and writes, per call: the method, the group's global ranks, the
arguments (tensors as CPU copies before the call; options as their fields) and every tensor after the call, which
is waited on at once. Groups asked for as gloo (host data on TPU too) are left out.
"""
import json
import os
import sys
from pathlib import Path
from typing import Any, List

RECORDINGS = Path(__file__).resolve().parent / "recordings"
TRAIN = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
_SMALL = ["--dim", "16", "--layers", "2", "--seq", "8", "--vocab", "32", "--steps", "2", "--warmup-steps", "0"]
# name: (ranks, DeepSpeed config, train.py arguments)
RUNS = {
    "zero1-2": (2, {"zero_optimization": {"stage": 1}}, []),
    "zero2-2": (2, {"zero_optimization": {"stage": 2}}, []),
    "zero2-noreducescatter-2": (2, {"zero_optimization": {"stage": 2, "reduce_scatter": False}}, []),
    "zero3-2": (2, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}, []),
    # each gradient slice reduced to its owner (dist.reduce) on the world and on the strided expert-data groups
    "zero2-moe-4": (4, {"zero_optimization": {"stage": 2, "use_multi_rank_bucket_allreduce": False}},
                    ["--moe-experts", "2"]),
    "zero1-pipe2x2-4": (4, {"zero_optimization": {"stage": 1}}, ["--pipeline-stages", "2"]),
}
METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
           "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
           "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "gather", "scatter", "alltoall", "alltoall_base",
           "barrier")
_OPTION_FIELDS = ("reduceOp", "rootRank", "rootTensor")


def _encode(value: Any, tensors: List) -> Any:
    import torch
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"tensor": len(tensors) - 1}
    if isinstance(value, (list, tuple)):
        return [_encode(item, tensors) for item in value]
    if value is None or isinstance(value, (int, float, str)):
        return value
    fields = {name: getattr(value, name) for name in _OPTION_FIELDS if hasattr(value, name)}
    if "reduceOp" in fields:
        fields["reduceOp"] = fields["reduceOp"].op.name if hasattr(fields["reduceOp"], "op") else str(fields["reduceOp"])
    return {"options": type(value).__name__, **fields}


def _record(out: Path) -> None:
    """Wrap this rank's ``xla_host`` collectives; write what they did at exit."""
    import atexit

    import torch
    import torch.distributed as dist

    from deepspeed_xla.comm import host_staged
    calls, gloo_asked = [], set()
    new_group = dist.new_group

    def noting_new_group(*args, **kwargs):
        group = new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and "gloo" in str(backend):
            gloo_asked.add(id(group))
        return group

    dist.new_group = noting_new_group

    def wrap(name: str):
        method = getattr(host_staged.HostStagedProcessGroup, name)

        def recorded(self, *args, **kwargs):
            tensors: List = []
            encoded = _encode(list(args), tensors)
            encoded_kwargs = {key: _encode(value, tensors) for key, value in kwargs.items()}
            before = [t.detach().cpu().clone() for t in tensors]
            work = method(self, *args, **kwargs)
            work.wait()
            if id(self) not in gloo_asked and dist.is_initialized():
                calls.append({"method": name, "ranks": dist.get_process_group_ranks(self),
                              "world": self is dist.group.WORLD, "args": encoded, "kwargs": encoded_kwargs,
                              "before": before,
                              "devices": [t.device.type for t in tensors],
                              "after": [t.detach().cpu().clone() for t in tensors]})
            return work

        setattr(host_staged.HostStagedProcessGroup, name, recorded)

    for name in METHODS:
        if hasattr(host_staged.HostStagedProcessGroup, name):
            wrap(name)
    atexit.register(lambda: torch.save(calls, f"{out}.rank{dist.get_rank() if dist.is_initialized() else 0}.pt"))


def _record_run(name: str) -> None:
    from tests.multiproc import ds_config, launch_command, run_job
    ranks, config, train_args = RUNS[name]
    base = ds_config(config["zero_optimization"]["stage"], micro_batch=2)
    base.update(config)
    RECORDINGS.mkdir(exist_ok=True)
    config_path = RECORDINGS / f"{name}.json"
    config_path.write_text(json.dumps(base, indent=1) + "\n")
    cmd, env = launch_command([Path(__file__).resolve(), "--record", RECORDINGS / name, "--deepspeed_config",
                               config_path, *_SMALL, *train_args], "xla", ranks, {"CPU_NUM_DEVICES": ranks})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TRAIN.parents[1]), env.get("PYTHONPATH")]))
    run_job(cmd, env, RECORDINGS, timeout=1200)
    print(f"{name}: {sum(1 for _ in RECORDINGS.glob(f'{name}.rank*.pt'))} ranks recorded", flush=True)


def main(argv: List[str]) -> None:
    argv = [arg for arg in argv if not arg.startswith("--local_rank")]  # the deepspeed launcher's
    if argv[:1] == ["--record"]:  # a launched rank: record, then train
        _record(Path(argv[1]))
        from deepspeed_xla.bench.example import load_example
        load_example(str(TRAIN)).main(argv[2:])
        return
    for name in argv or RUNS:
        _record_run(name)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(sys.argv[1:])
