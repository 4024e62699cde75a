"""Several ``scripts/train.py`` (or ``--script scripts/hf_train.py``) trainings, one after the other, in one
launched job.

    deepspeed --num_gpus 2 tests/train_many.py --runs runs.json
    # runs.json: [{"args": [the script's arguments], "hlo_dir": null or where this run's HLO dumps go,
    #              "env": {variables set for this run only}}, ...]

``tests.multiproc.Trainings`` launches the runs of one planned group this way: each is a fresh
``deepspeed.initialize`` on a fresh model, and the job's interpreters, imports and runtime start-up are paid
once instead of once per run. A run's ``env`` is what its launch would have exported differently (``accelerate
launch`` of another accelerate config file names another DeepSpeed config). Imports nothing from ``tests`` (no
pytest set-up in a launched worker).
"""
import argparse
import json
import os
from pathlib import Path

from deepspeed_xla.bench.example import load_example

TRAIN = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help="JSON file: the runs (see the module docstring)")
    parser.add_argument("--script", default=str(TRAIN), help="the training script whose main() each run calls")
    parser.add_argument("--hlo-dumps", type=Path, default=None,
                        help="the --xla_dump_to folder of XLA_FLAGS (one process): after each run, its files move to "
                             "that run's hlo_dir")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher; unused")
    args = parser.parse_args()
    train = load_example(args.script)
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import groups
    linear, mpu = torch.nn.functional.linear, groups.mpu
    for run in json.loads(Path(args.runs).read_text()):
        env = run.get("env", {})
        before = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        train.main(run["args"])
        for name, value in before.items():  # only the run's own: the first run's set-up filled in others
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
        # What DeepSpeed leaves to the rest of a process, which the next run (in a job of its own) would not
        # find: ZeRO-3's memory-efficient torch.nn.functional.linear ("This will persist unless manually
        # reset", it logs), a pipeline engine's grid in deepspeed.utils.groups.mpu, and the ZeRO optimizer
        # itself (its hooks keep it alive; DeepSpeed's CPU accelerator keeps the engine too). The views of that
        # optimizer's flat buffers its last step updated are pending on XLA: left alone, they join the next run's
        # first graph, which then matches no compiled graph (a new compilation of the whole step, every run).
        torch.nn.functional.linear, groups.mpu = linear, mpu
        if get_accelerator().device_name() == "xla":
            from deepspeed_xla import xla_runtime
            xla_runtime.sync()
        if run.get("hlo_dir"):
            take_dumps(args.hlo_dumps, Path(run["hlo_dir"]))


def take_dumps(dumps: Path, hlo_dir: Path) -> None:
    """Move what XLA dumped into ``dumps`` to ``hlo_dir``: the graphs this run compiled (earlier runs took theirs).
    A graph this run took from the compilation cache of an earlier run is not there."""
    hlo_dir.mkdir(parents=True, exist_ok=True)
    for path in dumps.iterdir():
        path.rename(hlo_dir / path.name)


if __name__ == "__main__":
    main()
