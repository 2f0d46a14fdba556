"""Which decoder runs a generative model version in this worker (`generate.runtime`): torch on a GPU
worker (bf16, CUDA graphs: server/engines/torch_decoder.py), ONNX Runtime on a CPU one
(server/engines/ort_decoder.py). torch is imported only when a model runs on it, so a CPU worker's
encoders stay as light as they are."""

from __future__ import annotations

import logging

from server.engines.decoding import Decoder
from server.engines.ort_decoder import OrtDecoder
from server.shared.generation_spec import DECODER_WEIGHTS_FILE
from server.shared.models import ModelSpec

log = logging.getLogger("infercache.decoders")


def open_decoder(spec: ModelSpec, version: str, threads: int, gpu: bool) -> Decoder:
    settings = spec.generation
    directory = spec.version_dir(version)
    choice = settings.runtime
    if choice == "auto":
        choice = "torch" if gpu else "onnxruntime"
        if choice == "torch" and not (directory / DECODER_WEIGHTS_FILE).is_file():
            log.warning("%s version %s runs on onnxruntime (CPU) on this GPU worker: %s is missing (run "
                        "prepare-model again)", spec.name, version, directory / DECODER_WEIGHTS_FILE)
            choice = "onnxruntime"
    if choice == "onnxruntime":
        return OrtDecoder(directory, threads, settings.max_streams, settings.context_length)
    import torch

    from server.engines import torch_decoder

    if not gpu:
        torch.set_num_threads(threads)
    return torch_decoder.load(directory, settings.max_streams, settings.context_length, "cuda" if gpu else "cpu")


def prefix_cache(spec: ModelSpec, version: str, decoder: Decoder, gpu: bool, disk):
    """The version's prefix cache (server/worker/prefix/prefix_cache.py), or None where its config turns it off or
    its decoder keeps no blocks. Its memory: a share of the device memory free after loading on a GPU
    worker, with pinned host memory beside it; host memory on a CPU worker."""
    settings = spec.prefix
    if not settings.enabled or decoder.block_bytes(settings.block_tokens) == 0:
        return None
    from server.worker.prefix.prefix_cache import PrefixCache

    host = settings.host_mb << 20
    if gpu and decoder.runtime == "torch":
        import torch

        memory = settings.device_mb << 20 or int(settings.device_fraction * torch.cuda.mem_get_info()[0])
    else:
        memory, host = host, 0
    return PrefixCache(settings, decoder, spec.name, version, memory_bytes=memory, host_bytes=host, disk=disk)
