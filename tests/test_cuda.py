"""CUDA buffers of the TensorRT path (cuda-python, no torch). Needs an NVIDIA GPU: skips without one."""

from __future__ import annotations

import numpy as np
import pytest

from server.engines.cuda import Buffer, Stream, device_info

GPU = device_info()
pytestmark = pytest.mark.skipif(GPU is None, reason="needs an NVIDIA GPU and cuda-bindings; this host has neither")


def test_round_trip_through_device_memory_on_a_stream():
    stream = Stream()
    buffer = Buffer(4 * 32 * 256 * 8)
    data = np.random.default_rng(1).integers(0, 30000, size=(32, 256), dtype=np.int64)
    buffer.upload(data, stream)
    back = buffer.download(np.int64, data.shape, stream)
    stream.synchronize()
    np.testing.assert_array_equal(back, data)
    with pytest.raises(ValueError, match="do not fit"):
        buffer.upload(np.zeros(buffer.nbytes + 8, dtype=np.uint8), stream)
    buffer.close()
    stream.close()


def test_device_tag_names_the_architecture():
    assert GPU.tag.startswith(f"sm{GPU.major}{GPU.minor}-") and GPU.total_memory > 0
