"""Pooled host buffers: handed out again only when neither a host view nor an XLA tensor holds them."""
import gc

import pytest
import torch

from deepspeed_xla import xla_runtime
from deepspeed_xla.comm import host_buffers

SHAPE = (1024,)  # 4 KB of float32: pooled once the threshold is lowered below it


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(host_buffers, "POOLED_BYTES", 1024)
    monkeypatch.setattr(host_buffers, "_POOL", {})
    return host_buffers


def test_buffer_comes_back_when_xla_lets_go(pool, xla_device):
    first = pool.empty(SHAPE, torch.float32)
    first_ptr = first.data_ptr()
    second = pool.empty(SHAPE, torch.float32)
    second_ptr = second.data_ptr()
    assert second_ptr != first_ptr, "a buffer a host view still uses was handed out again"
    del second
    assert pool.empty(SHAPE, torch.float32).data_ptr() == second_ptr, "an idle pooled buffer was not reused"

    first.copy_(torch.arange(SHAPE[0], dtype=torch.float32))
    adopted = torch.zeros(SHAPE, device=xla_device)
    adopted.copy_(xla_runtime.device_alias(first))  # how host_staged writes a result back on PJRT CPU
    del first
    xla_runtime.sync()
    busy = [pool.empty(SHAPE, torch.float32) for _ in range(2)]
    assert first_ptr not in [b.data_ptr() for b in busy], "a buffer an XLA tensor holds was handed out again"
    assert torch.equal(adopted.cpu(), torch.arange(SHAPE[0], dtype=torch.float32))

    del adopted, busy
    gc.collect()
    xla_runtime.sync()
    assert {pool.empty(SHAPE, torch.float32).data_ptr() for _ in range(2)} <= {first_ptr, second_ptr}


def test_views_take_the_asked_shape_and_dtype(pool):
    buffer = pool.empty((32, 32), torch.bfloat16)
    assert (buffer.shape, buffer.dtype, buffer.is_contiguous()) == ((32, 32), torch.bfloat16, True)
    assert list(pool._POOL) == [2048]
    assert pool.empty((2048,), torch.uint8).data_ptr() != buffer.data_ptr(), "same bytes, but still in use"


def test_small_buffers_and_extra_ones_are_not_kept(pool):
    pool.empty((8,), torch.float32)
    held = [pool.empty(SHAPE, torch.float32) for _ in range(pool.PER_SIZE + 1)]
    assert list(pool._POOL) == [SHAPE[0] * 4], "only buffers over POOLED_BYTES are pooled"
    assert len(pool._POOL[SHAPE[0] * 4]) == pool.PER_SIZE
    assert len({b.data_ptr() for b in held}) == len(held)
