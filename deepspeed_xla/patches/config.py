"""Patches of DeepSpeed's config parsing (``deepspeed.runtime.config``): config checks, timer device waits.

``DeepSpeedConfig`` is where a bad setting can be refused before anything touches the device, and where
DeepSpeed decides that its throughput timer waits for the device twice a step, which on XLA stops the
host from tracing the next step while the device runs this one.
"""
import functools


def configure_train_batch_size(original):
    """Refuse settings XLA cannot run (``config_checks``) as DeepSpeed parses the config, before it derives
    batch sizes or builds anything; and explain DeepSpeed's bare batch-size assertion with the fix."""

    @functools.wraps(original)
    def configure_train_batch_size(self):
        from deepspeed_xla import config_checks
        config_checks.check_config(self)
        try:
            return original(self)
        except AssertionError:
            config_checks.check_batch_size(self)
            raise

    return configure_train_batch_size


def timers_without_device_wait(original):
    """The throughput timer waits for the device only if the config asks (``timers.throughput.synchronized``).

    DeepSpeed's default waits at the start and the end of every step, for exact step times on CUDA. On XLA
    the wait stops the host from tracing the next step while the device runs this one, the overlap lazy
    execution lives on; memory stays bounded without it, since torch_xla's next ``sync()`` waits for the
    previous execution. Unwaited, the timer reports the host's pace, which is the device's once steady.
    """

    @functools.wraps(original)
    def get_timers_config(param_dict):
        config = original(param_dict)
        if "synchronized" not in config.model_fields_set:
            config.synchronized = False
        return config

    return get_timers_config
