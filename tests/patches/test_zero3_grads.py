"""``patches/zero3_grads.py``: ZeRO-3's flat gradient buffer holds upstream's values after every backward, written
once per backward instead of once per parameter."""
import inspect

import torch


def zero3_gradients_against_upstream():
    """Run by ``run_ranks``: ZeRO-3's flat gradient buffer after every backward, trained with the patched
    ``partition_grads`` and epilogue and then with upstream's, from the same seed and data; reduce buckets smaller
    than the parameters, two micro-steps a step, with and without ``contiguous_gradients``. Every tensor's size but
    one is even: a bucket of one such tensor is reduce-scattered in place, its partitions views of the bucket's
    buffer. The last bias has one element, so the second rank's partition of it is padding only: a span of the
    buffer that rank never writes."""
    import json
    import deepspeed
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    from deepspeed.utils import groups
    names = ("partition_grads", "independent_gradient_partition_epilogue")
    patched = {name: getattr(Stage3, name) for name in names}
    found = {}
    for contiguous in (False, True):
        for side in ("patched", "upstream"):
            for name in names:
                setattr(Stage3, name, patched[name] if side == "patched" else inspect.unwrap(patched[name]))
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4),
                                        torch.nn.Tanh(), torch.nn.Linear(4, 1))
            config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                      "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                            "reduce_bucket_size": 40, "contiguous_gradients": contiguous}}
            engine, optimizer, *_ = deepspeed.initialize(model=model, config=config)
            gen = torch.Generator().manual_seed(1 + engine.global_rank)
            buffers = []
            for _ in range(6):
                engine.backward(engine(torch.randn(4, 8, generator=gen).to(engine.device)).pow(2).mean())
                buffers.append(optimizer.grad_partitions_flat_buffer.cpu().tolist())
                engine.step()
            found[f"{contiguous}-{side}"] = buffers
            engine.destroy()
            groups._release_process_group_references()
    for name in names:
        setattr(Stage3, name, patched[name])
    print(json.dumps(found))


def test_zero3_writes_the_gradients_upstream_writes():
    """``stage3_partition_grads`` keeps each bucket's partitions until the backward's epilogue (one write of the flat
    buffer per backward, not per bucket; per bucket with ``contiguous_gradients``, whose partitions are views of the
    bucket's reused buffer): after every backward the buffer holds exactly upstream's values, accumulating too."""
    import json
    from tests.multiproc import run_ranks
    for proc in run_ranks("tests.patches.test_zero3_grads:zero3_gradients_against_upstream", 2,
                          env={"DS_ACCELERATOR": "xla"}):
        assert proc.returncode == 0, proc.stderr[-6000:]
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        for contiguous in (False, True):
            mine, theirs = found[f"{contiguous}-patched"], found[f"{contiguous}-upstream"]
            assert len(mine) == 6 and len({str(buffer) for buffer in theirs}) == 6  # the gradients change
            assert mine == theirs, contiguous
