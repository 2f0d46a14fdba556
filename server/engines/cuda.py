"""CUDA through cuda-python (`cuda.bindings.runtime`): streams, device and pinned host buffers.

No torch in the TensorRT path. Imported only by runtimes that need a GPU; `device_info()` answers
None on a host without CUDA or without a GPU, so callers can fall back or skip with a reason.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np


class CudaError(RuntimeError):
    pass


def _cudart():
    from cuda.bindings import runtime  # cuda-bindings (cuda-python)

    return runtime


def check(result):
    """cuda-python returns (err, *values); raises on error, returns the values."""
    cudart = _cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        _, message = cudart.cudaGetErrorString(err)
        raise CudaError(f"{err.name}: {message.decode() if isinstance(message, bytes) else message}")
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    major: int
    minor: int
    total_memory: int

    @property
    def tag(self) -> str:
        return f"sm{self.major}{self.minor}-{self.name.lower().replace(' ', '-')}"


def device_info(index: int = 0) -> GpuInfo | None:
    try:
        cudart = _cudart()
        if check(cudart.cudaGetDeviceCount()) <= index:
            return None
        props = check(cudart.cudaGetDeviceProperties(index))
    except (ImportError, CudaError, OSError, RuntimeError):
        return None
    name = props.name.decode(errors="replace").rstrip("\x00") if isinstance(props.name, bytes) else str(props.name)
    return GpuInfo(index, name, props.major, props.minor, props.totalGlobalMem)


class Stream:
    def __init__(self) -> None:
        self.handle = check(_cudart().cudaStreamCreate())

    def synchronize(self) -> None:
        check(_cudart().cudaStreamSynchronize(self.handle))

    def close(self) -> None:
        check(_cudart().cudaStreamDestroy(self.handle))


class Buffer:
    """A device buffer with a pinned host twin of the same size, for async copies on one stream."""

    def __init__(self, nbytes: int) -> None:
        cudart = _cudart()
        self.nbytes = nbytes
        self.device = check(cudart.cudaMalloc(nbytes))
        self.host = check(cudart.cudaMallocHost(nbytes))
        self._host_view = (ctypes.c_byte * nbytes).from_address(int(self.host))

    def host_array(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        return np.frombuffer(self._host_view, dtype=dtype, count=count).reshape(shape)

    def upload(self, array: np.ndarray, stream: Stream) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes > self.nbytes:
            raise ValueError(f"{array.nbytes} bytes do not fit a {self.nbytes}-byte buffer")
        np.copyto(self.host_array(array.dtype, array.shape), array)
        check(_cudart().cudaMemcpyAsync(self.device, self.host, array.nbytes,
                                        _cudart().cudaMemcpyKind.cudaMemcpyHostToDevice, stream.handle))

    def download(self, dtype: np.dtype, shape: tuple[int, ...], stream: Stream) -> np.ndarray:
        """Enqueues the copy back; the returned view is valid after stream.synchronize()."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        check(_cudart().cudaMemcpyAsync(self.host, self.device, nbytes,
                                        _cudart().cudaMemcpyKind.cudaMemcpyDeviceToHost, stream.handle))
        return self.host_array(dtype, shape)

    def close(self) -> None:
        check(_cudart().cudaFree(self.device))
        check(_cudart().cudaFreeHost(self.host))
