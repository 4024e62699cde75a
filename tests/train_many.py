"""Several ``scripts/train.py`` trainings, one after the other, in one launched job.

    deepspeed --num_gpus 2 tests/train_many.py --runs runs.json    # runs.json: a list of train.py argument lists

``tests.multiproc.Trainings`` launches the runs of one planned group this way: each is a fresh
``deepspeed.initialize`` on a fresh model, and the job's interpreters, imports and runtime start-up are paid
once instead of once per run. Imports nothing from ``tests`` (no pytest set-up in a launched worker).
"""
import argparse
import json
from pathlib import Path

from deepspeed_xla.bench.example import load_example

TRAIN = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help="JSON file: a list of scripts/train.py argument lists")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher; unused")
    args = parser.parse_args()
    train = load_example(str(TRAIN))
    import torch
    from deepspeed.utils import groups
    linear, mpu = torch.nn.functional.linear, groups.mpu
    for argv in json.loads(Path(args.runs).read_text()):
        train.main(argv)
        # What DeepSpeed leaves to the rest of a process, which the next run (in a job of its own) would not
        # find: ZeRO-3's memory-efficient torch.nn.functional.linear ("This will persist unless manually
        # reset", it logs) and a pipeline engine's grid in deepspeed.utils.groups.mpu.
        torch.nn.functional.linear, groups.mpu = linear, mpu


if __name__ == "__main__":
    main()
