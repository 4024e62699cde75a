"""``patches/config.py``: the throughput timer waits for the device only when the config asks."""
import torch


def count_device_waits():
    """Run by ``run_ranks``: device waits during steady-state steps of a default and a ``synchronized`` config."""
    import json
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    waits = []
    synchronize = accelerator.synchronize
    accelerator.synchronize = lambda *args, **kwargs: (waits.append(1), synchronize(*args, **kwargs))[1]
    counts = {}
    for name, timers in (("default", {}), ("synchronized", {"throughput": {"synchronized": True}})):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                  "zero_optimization": {"stage": 2}, "timers": timers}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        x = torch.randn(4, 8).to(engine.device)
        for step in range(6):
            if step == 3:  # DeepSpeed's throughput timer starts timing at step 2
                waits.clear()
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        counts[name] = len(waits)
    print(json.dumps(counts))


def test_steps_wait_for_the_device_only_when_the_config_asks():
    """DeepSpeed's throughput timer waits for the device twice a step by default; on XLA that stops the host
    from tracing step N+1 while the device runs step N. ``timers.throughput.synchronized`` set: as asked."""
    import json
    from tests.multiproc import run_ranks
    [proc] = run_ranks("tests.patches.test_config:count_device_waits", 1, env={"DS_ACCELERATOR": "xla"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts == {"default": 0, "synchronized": 2 * 3}
