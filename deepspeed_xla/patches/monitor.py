"""DeepSpeed's monitors (``deepspeed.monitor``: csv, TensorBoard, wandb, comet) get XLA's counters too.

The engine hands its monitors the learning rate each step, and its timers and loss where configured; on XLA the
questions a run raises first are whether a step compiles again, reads the device, or nears the memory limit. Every
``steps_per_print`` optimizer steps (DeepSpeed's progress log), rank 0 writes ``xla_counters``' figures beside the
engine's events, at the same x (``global_samples``).
"""
import functools


def xla_counters_every_print(original):
    """``DeepSpeedEngine._take_model_step`` (the pipeline engine's too), after the step's graph is cut (``engine
    .sync_after``, inside this wrapper): the step's compilation is counted, its execution after the one wait for the
    device that reading the counters takes, on rank 0 alone and only with a monitor enabled."""

    @functools.wraps(original)
    def take_model_step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        every = self.steps_per_print()
        if self.monitor.enabled and self.global_rank == 0 and every and self.global_steps % every == 0:
            from deepspeed.accelerator import get_accelerator
            from deepspeed_xla import xla_counters
            accelerator = get_accelerator()
            self.monitor.write_events(
                xla_counters.monitor_events(self.global_samples, accelerator.device_type,
                                            accelerator.current_device()))
        return result

    return take_model_step
