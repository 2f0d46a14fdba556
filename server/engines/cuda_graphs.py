"""Capturing a CUDA graph, for the torch engines (encoders: torch_cuda.py; decoders: torch_decoder.py).

torch.cuda.graph prepares each capture with a full garbage collection and an emptied allocator cache:
about 60 ms of the 70 ms a MiniLM graph took on an H200, and an engine captures dozens. Here the graph
is captured without them (the engines capture before anything they allocate is freed), in thread_local
mode: other threads of the process keep serving, waiting on their events, while it is captured.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def capture(forward: Callable[[], T], pool, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, T]:
    """forward() captured on `stream` into a graph sharing the memory pool `pool`; (graph, what forward
    returned: its output tensors, which each replay rewrites). Run the forward once eagerly on `stream`
    first: the libraries' handles and workspaces must exist before a capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            outputs = forward()
        finally:
            graph.capture_end()
    return graph, outputs
