"""``xla_counters``: XLA's counters and memory figures, named as DeepSpeed names its monitor events."""
import resource

import torch

from deepspeed_xla import xla_counters


def test_counters_are_torch_xlas_metrics_and_reading_them_runs_nothing(xla_device):
    """After a graph and two reads of 4 + 4,000 bytes, the counters are torch_xla's metrics, read directly; reading
    them again adds no execution, transfer or compilation."""
    import torch_xla.debug.metrics as met
    x = torch.ones(1000, device=xla_device) * 2
    (x + 1).sum().item()
    (x * 3).cpu()
    counted = xla_counters.counters()
    assert xla_counters.counters() == counted
    assert counted == {"xla_compilations": met.metric_data("CompileTime")[0],
                       "xla_compile_seconds": met.metric_data("CompileTime")[1] / 1e9,
                       "xla_executions": met.metric_data("ExecuteTime")[0],
                       "xla_transfers_to_host": met.metric_data("TransferFromDeviceTime")[0],
                       "xla_transfer_to_host_bytes": int(met.metric_data("InboundData")[1])}
    assert counted["xla_transfers_to_host"] >= 2 and counted["xla_transfer_to_host_bytes"] >= 4004


class _Device:
    """A device type whose runtime keeps allocator statistics (TPU's), or none (``stats=None``: PJRT CPU's)."""

    def __init__(self, stats):
        self.stats = stats

    def memory_info(self, device):
        return None if self.stats is None else dict(self.stats)


def test_memory_is_the_runtimes_where_it_has_figures_and_the_hosts_named_as_such_otherwise():
    runtime = xla_counters.memory(_Device({"bytes_used": 3, "bytes_limit": 10, "peak_bytes_used": 7}), "xla:0")
    assert runtime == {"xla_device_memory_in_use_bytes": 3, "xla_device_memory_peak_bytes": 7}
    older = xla_counters.memory(_Device({"bytes_used": 3, "bytes_limit": 10}), "xla:0")  # no peak before torch_xla 2.6
    assert older == {"xla_device_memory_in_use_bytes": 3, "xla_device_memory_peak_bytes": 3}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    host = xla_counters.memory(_Device(None), "xla:0")
    assert host.keys() == {"host_memory_in_use_bytes", "host_memory_peak_bytes"}
    assert 0 < host["host_memory_in_use_bytes"] <= host["host_memory_peak_bytes"]
    after = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, host["host_memory_in_use_bytes"])
    assert before <= host["host_memory_peak_bytes"] <= after


def test_events_are_named_and_placed_as_the_engines(xla_device):
    events = xla_counters.monitor_events(24, _Device({"bytes_used": 3, "peak_bytes_used": 7}), "xla:0")
    assert all(name.startswith("Train/Samples/") and samples == 24 for name, _, samples in events)
    assert {name.split("/")[-1] for name, _, _ in events} == {
        *xla_counters.counters(), "xla_device_memory_in_use_bytes", "xla_device_memory_peak_bytes"}
