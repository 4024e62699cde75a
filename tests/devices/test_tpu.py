"""TPU per-process topology against torch_xla's own ``configure_topology``, on faked TPU VM metadata; the chip count
from PCI, with tpu-info and without.

No TPU is needed: with ``TPU_SKIP_MDS_QUERY`` torch_xla reads the metadata from the environment.
"""
import os
import sys

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


def fake_metadata(monkeypatch, host):
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
        fake_metadata(monkeypatch, host)
        tpu.configure_topology(local_rank, local_size)
        expected = {key: os.environ[key] for key in OUTPUTS}
        fake_metadata(monkeypatch, host)
        ours = dict(os.environ)
        TpuDevice().configure_process(local_rank, local_size, node_rank=HOSTS[host][5], env=ours)
        assert {key: ours[key] for key in OUTPUTS} == expected, f"{host} local rank {local_rank}"
        assert ours["PJRT_LOCAL_PROCESS_RANK"] == str(local_rank)
        assert ours["PJRT_LOCAL_PROCESS_COUNT"] == str(local_size)


STALE = {"TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "CLOUD_TPU_TASK_ID": "0",
         "TPU_PROCESS_ADDRESSES": "localhost:8476"}


@pytest.mark.parametrize("local_size", [4, 1])
def test_stale_topology_variables_are_replaced_naming_each(monkeypatch, local_size):
    """A single-process recipe's values (or a .deepspeed_env's) left in the environment: each process gets what
    torch_xla writes into a clean environment (``configure_topology``, or ``configure_one_chip_topology`` for a lone
    process), and the warning names each value it replaced."""
    from torch_xla._internal import tpu
    fake_metadata(monkeypatch, "v4-8")
    if local_size == 1:
        tpu.configure_one_chip_topology()
    else:
        tpu.configure_topology(1, local_size)
    expected = {key: os.environ.get(key) for key in STALE}
    fake_metadata(monkeypatch, "v4-8")
    env = dict(os.environ, **STALE)
    with pytest.warns(UserWarning) as warned:
        TpuDevice().configure_process(1 % local_size, local_size, 0, env)
    assert {key: env.get(key) for key in STALE} == expected
    message = str(warned[0].message)
    replaced = [key for key in STALE if STALE[key] != expected[key]]
    assert replaced and all(f"{key}={STALE[key]!r}" in message for key in replaced), message
    assert "Remove them from the environment and .deepspeed_env" in message


def test_each_rank_takes_its_chip_from_the_launchers_list(monkeypatch):
    fake_metadata(monkeypatch, "v6e-8")
    env = dict(os.environ, TPU_VISIBLE_CHIPS="4,5,6,7")
    TpuDevice().configure_process(2, 4, 0, env)
    assert env["TPU_VISIBLE_CHIPS"] == "6"


def test_more_ranks_than_listed_chips_is_an_error(monkeypatch):
    fake_metadata(monkeypatch, "v6e-8")
    with pytest.raises(RuntimeError, match="--num_gpus 2"):
        TpuDevice().configure_process(2, 3, 0, dict(os.environ, TPU_VISIBLE_CHIPS="0,1"))


def test_chip_count_without_tpu_is_zero():
    assert TpuDevice().local_device_count() == 0
    assert not TpuDevice().is_present()


@pytest.mark.parametrize("library_path", [None, "/opt/libtpu/libtpu.so"])
def test_libtpu_is_found_where_torch_xla_looks(monkeypatch, library_path):
    import torch_xla

    from deepspeed_xla.devices.tpu import libtpu_path
    monkeypatch.setenv("PTXLA_TPU_LIBRARY_PATH", "")  # torch_xla writes it; monkeypatch restores it
    monkeypatch.delenv("PTXLA_TPU_LIBRARY_PATH")
    if library_path:
        monkeypatch.setenv("TPU_LIBRARY_PATH", library_path)
    else:
        monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    ours = libtpu_path()
    assert (ours is not None) == torch_xla._setup_tpu_vm_library_path()
    assert ours == (os.environ.get("TPU_LIBRARY_PATH") or os.environ.get("PTXLA_TPU_LIBRARY_PATH"))


def _fake_chips(monkeypatch, chip_name, count):
    from tpu_info import device
    chip = getattr(device.TpuChip, chip_name) if chip_name else None
    monkeypatch.setattr(device, "get_local_chips", lambda: (chip, count))


def test_setup_problems_name_the_fix(monkeypatch):
    from deepspeed_xla.devices import tpu
    from deepspeed_xla.xla_runtime import base_version, installed_version
    monkeypatch.setenv("TPU_LIBRARY_PATH", "/opt/libtpu/libtpu.so")
    _fake_chips(monkeypatch, "V5E", 4)
    assert TpuDevice().describe() == "4 x TPU v5e chip; libtpu: /opt/libtpu/libtpu.so"
    assert TpuDevice().setup_problems() == []
    _fake_chips(monkeypatch, "V3", 4)
    with pytest.raises(RuntimeError) as raised:
        tpu.tpu_process_env(0, 4, {}, 3, ["localhost"])
    assert TpuDevice().setup_problems() == [str(raised.value)]
    _fake_chips(monkeypatch, None, 0)
    monkeypatch.setattr(tpu, "libtpu_path", lambda: None)
    assert TpuDevice().setup_problems() == [
        "PJRT_DEVICE=TPU but this host has no TPU chips on PCI: run on a Cloud TPU VM, or set PJRT_DEVICE=CPU.",
        "libtpu (PJRT's TPU plugin) is not installed: pip install "
        f"'torch_xla[tpu]=={base_version(installed_version('torch_xla'))}' (or set TPU_LIBRARY_PATH to a libtpu.so)."]


def test_peak_flops_are_per_device(monkeypatch):
    """MFU divides by one device's peak: TPU7x chips hold two devices (two processes), other generations one."""
    _fake_chips(monkeypatch, "V6E", 8)
    assert TpuDevice().peak_bf16_flops() == 918e12
    _fake_chips(monkeypatch, "V7X", 4)
    assert TpuDevice().peak_bf16_flops() == 2307e12 / 2
    _fake_chips(monkeypatch, None, 0)
    assert TpuDevice().peak_bf16_flops() is None


def _fake_pci(root, devices):
    for index, (vendor, device) in enumerate(devices):
        folder = root / f"0000:00:{index:02x}.0"
        folder.mkdir(parents=True)
        (folder / "vendor").write_text(f"{vendor}\n")
        (folder / "device").write_text(f"{device}\n")


def test_without_tpu_info_only_tpu_device_ids_count(tmp_path, monkeypatch):
    """A GCE VM's gVNIC (0x0042) and Persistent Disk NVMe (0x001f) share Google's vendor id with TPU chips."""
    from deepspeed_xla.devices import tpu
    _fake_pci(tmp_path, [("0x1ae0", "0x0042"), ("0x1ae0", "0x001f"), ("0x8086", "0x005e"), ("0x1ae0", "0x005e"),
                         ("0x1ae0", "0x005e")])
    (tmp_path / "0000:00:09.0").mkdir()  # a device whose files cannot be read
    monkeypatch.setattr(tpu, "PCI_DEVICES", str(tmp_path))
    monkeypatch.setitem(sys.modules, "tpu_info", None)  # import tpu_info fails
    assert TpuDevice().local_device_count() == 2
    _fake_pci(tmp_path / "gce", [("0x1ae0", "0x0042"), ("0x1ae0", "0x001f")])
    monkeypatch.setattr(tpu, "PCI_DEVICES", str(tmp_path / "gce"))
    assert not TpuDevice().is_present()


def test_failing_tpu_info_scan_counts_no_chips_with_a_warning(monkeypatch):
    from tpu_info import device

    def unreadable():
        raise OSError(2, "No such file or directory", "/sys/bus/pci/devices/0000:00:04.0/device")

    monkeypatch.setattr(device, "get_local_chips", unreadable)
    with pytest.warns(UserWarning, match=r"could not scan .*FileNotFoundError.*counting no TPU chips"):
        assert not TpuDevice().is_present()
