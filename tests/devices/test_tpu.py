"""TPU per-process topology against torch_xla's own ``configure_topology``, on faked TPU VM metadata.

No TPU is needed: with ``TPU_SKIP_MDS_QUERY`` torch_xla reads the metadata from the environment.
"""
import os

import pytest

from deepspeed_xla.devices.tpu import TpuDevice

OUTPUTS = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES",
           "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID")

HOSTS = {
    # name: (accelerator type, host bounds, chips per host, chips per host count, worker hostnames, worker id)
    "v4-8": ("v4-8", "1,1,1", "2,2,1", 4, "localhost", 0),
    "v5litepod-8": ("v5litepod-8", "1,1,1", "2,4,1", 8, "localhost", 0),
    "v5p-8": ("v5p-8", "1,1,1", "2,2,1", 4, "localhost", 0),
    "v6e-8": ("v6e-8", "1,1,1", "2,4,1", 8, "localhost", 0),
    "v4-32-worker1": ("v4-32", "1,1,4", "2,2,1", 4, "10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4", 1),
}


def _fake_metadata(monkeypatch, host):
    accel_type, host_bounds, chips_per_host, _, hostnames, worker = HOSTS[host]
    for key in OUTPUTS + ("PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accel_type)
    monkeypatch.setenv("TPU_HOST_BOUNDS", host_bounds)
    monkeypatch.setenv("TPU_CHIPS_PER_HOST_BOUNDS", chips_per_host)
    monkeypatch.setenv("TPU_WORKER_ID", str(worker))
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", hostnames)


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_process_env_equals_torch_xla(monkeypatch, host):
    from torch_xla._internal import tpu
    local_size = HOSTS[host][3]
    for local_rank in range(local_size):
        _fake_metadata(monkeypatch, host)
        tpu.configure_topology(local_rank, local_size)
        expected = {key: os.environ[key] for key in OUTPUTS}
        _fake_metadata(monkeypatch, host)
        ours = dict(os.environ)
        TpuDevice().configure_process(local_rank, local_size, node_rank=HOSTS[host][5], env=ours)
        assert {key: ours[key] for key in OUTPUTS} == expected, f"{host} local rank {local_rank}"
        assert ours["PJRT_LOCAL_PROCESS_RANK"] == str(local_rank)
        assert ours["PJRT_LOCAL_PROCESS_COUNT"] == str(local_size)


def test_each_rank_takes_its_chip_from_the_launchers_list(monkeypatch):
    _fake_metadata(monkeypatch, "v6e-8")
    env = dict(os.environ, TPU_VISIBLE_CHIPS="4,5,6,7")
    TpuDevice().configure_process(2, 4, 0, env)
    assert env["TPU_VISIBLE_CHIPS"] == "6"


def test_more_ranks_than_listed_chips_is_an_error(monkeypatch):
    _fake_metadata(monkeypatch, "v6e-8")
    with pytest.raises(RuntimeError, match="--num_gpus 2"):
        TpuDevice().configure_process(2, 3, 0, dict(os.environ, TPU_VISIBLE_CHIPS="0,1"))


def test_chip_count_without_tpu_is_zero():
    assert TpuDevice().local_device_count() == 0
    assert not TpuDevice().is_present()
