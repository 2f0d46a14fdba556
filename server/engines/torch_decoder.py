"""A generative model's decoder on torch (server/engines/llama.py): on a GPU in bf16 with its decode steps
under CUDA graphs, pipelined; on a CPU in fp32, eager (tests run the same code there).

Memory: one pool of key/value slots, allocated once: [layers, slots, kv_heads, context + 1, head_dim]
for keys and the same for values. A sequence owns one slot from its first prompt token to its end (the
scheduler picks the lowest free one, so running sequences stay near the front). The last position of
every slot is scratch: padding tokens and idle rows write there, and nothing reads it.

A step, on the decoder's stream: explicit input tokens are scattered into the slots' token buffer; one
decode step for rows 0..R-1 (R the smallest batch class holding every row's slot; rows without a token
this step are idle and write only scratch), replaying the CUDA graph captured for (R, span class), where
the span class is the smallest captured number of positions covering every row; then the prompt chunks:
a step's only chunk, up to 512 tokens, padded to a width class and replayed from the graph of (width,
span class); otherwise batched and padded to the longest, eager (long chunks are arithmetic-bound:
launches are not what costs); each chunk's argmax goes to its slot's token buffer, the next decode step's input. The argmax of
each row and each last chunk, and the scores asked for, are copied to pinned host memory, and an event
is recorded: `collect` waits on it. Nothing in a step waits for the host, so the scheduler launches step
n+1 before it reads step n (`pipelined`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np
import torch

from server.engines.cuda_graphs import capture
from server.engines.decoding import Decoder, Step, StepOutcome
from server.engines.llama import Llama, LlamaArchitecture
from server.shared.generation_spec import DECODER_WEIGHTS_FILE
from server.engines.torch_cuda import batch_classes

log = logging.getLogger("infercache.torch_decoder")

SPAN_UNIT = 256  # decode steps attend a multiple of this many positions (batch_classes of it)
PREFILL_ALIGN = 64  # a prompt chunk attends its positions rounded up to this
# A step's only prompt chunk, when it is this short, is padded to the smallest of these widths and, on a
# GPU, replayed from a graph per (width, span class): launching a chunk's ~25 kernels a layer eagerly costs
# the host ~1 ms a layer (30 ms for an 8B model), several times what the GPU spends on 64 tokens, which
# is what a prefix cache hit or a conversation's next turn leaves to compute. Longer chunks keep the eager
# path, whose launches the GPU's arithmetic hides.
CHUNK_WIDTHS = (32, 64, 128, 256, 512)


def span_classes(context: int) -> tuple[int, ...]:
    """256, 512, 768, 1024, 1536, 2048, ... (as batch classes, in units of 256) up to the context."""
    units = -(-context // SPAN_UNIT)
    return tuple(sorted({min(context, c * SPAN_UNIT) for c in batch_classes(units)}))


def _first_at_least(classes: tuple[int, ...], n: int) -> int:
    for c in classes:
        if c >= n:
            return c
    raise ValueError(f"{n} exceeds the largest class {classes[-1]}")


class _Launched:
    __slots__ = ("event", "tokens", "scores", "exports", "outcome")

    def __init__(self) -> None:
        self.event = None
        self.tokens = None                 # host tensor: argmax of chunks then rows
        self.scores: dict[int, torch.Tensor] = {}
        self.exports: list = []            # (tag, pinned host block)
        self.outcome: StepOutcome | None = None  # computed already (CPU)


class TorchDecoder(Decoder):
    runtime = "torch"

    def __init__(self, module: Llama, slots: int, context: int, *, graphs: bool | None = None) -> None:
        arch = module.arch
        self.module = module
        self.arch = arch
        parameter = module.embed
        self.dtype, self.torch_device = parameter.dtype, parameter.device
        cuda = self.torch_device.type == "cuda"
        self.graphed = cuda if graphs is None else graphs
        self.pipelined = cuda
        self.slots, self.context = slots, context
        self.scratch = context  # the last position of every slot
        self.precision = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        self.device = (f"cuda:{self.torch_device.index or 0} ({torch.cuda.get_device_name(self.torch_device)})"
                       if cuda else "cpu")
        shape = (arch.layers, slots, arch.kv_heads, context + 1, arch.head_dim)
        before = torch.cuda.memory_allocated(self.torch_device) if cuda else 0
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.torch_device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.torch_device)
        self.tokens = torch.zeros(slots, dtype=torch.int64, device=self.torch_device)  # each slot's next input
        self.positions = torch.full((slots,), self.scratch, dtype=torch.int64, device=self.torch_device)
        self.batches = batch_classes(slots)
        self.spans = span_classes(context)
        self.stream = torch.cuda.Stream(self.torch_device) if cuda else None
        self._copies = torch.cuda.Stream(self.torch_device) if cuda else None  # block exports beside compute
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # single-chunk prefill graphs by (width, span): what they read (ids, positions, slot, last index)
        self._chunk_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._chunk_inputs: dict[int, torch.Tensor] = {}
        self._counters: Counter[str] = Counter()
        self.capture_s = 0.0
        self.blocks: torch.Tensor | None = None  # prefix blocks (open_blocks)
        self.block_tokens = 0
        if self.graphed:
            self._capture_all()
        self._memory = (torch.cuda.memory_allocated(self.torch_device) - before) if cuda else 0

    # -- steps -------------------------------------------------------------------------------------------

    def launch(self, step: Step) -> _Launched:
        handle = _Launched()
        with torch.inference_mode(), _on(self.stream):
            exports, exported = self._exports(step.exports)
            if step.restores:
                self._restore_all(step.restores)
            parts = []
            scores: list[tuple[int, torch.Tensor]] = []
            if step.rows:
                decoded, logits = self._decode(step)
            if step.chunks:
                prefilled, chunk_logits = self._prefill(step)
                parts.append(prefilled)
                scores += [(i, chunk_logits[i]) for i, c in enumerate(step.chunks) if c.scores]
            if step.rows:
                parts.append(decoded)
                base = len(step.chunks)
                scores += [(base + i, logits[r.slot]) for i, r in enumerate(step.rows) if r.scores]
            if exported is not None:
                self.stream.wait_event(exported)  # the blocks it keeps into were copied out first
            for keep in step.keeps:
                self._keep(keep)
            tokens = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else None
            if self.pipelined:
                if tokens is not None:
                    handle.tokens = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
                    handle.tokens.copy_(tokens, non_blocking=True)
                for index, row in scores:
                    host = torch.empty(row.shape, dtype=torch.float32, pin_memory=True)
                    host.copy_(row.float(), non_blocking=True)
                    handle.scores[index] = host
                handle.exports = exports
                handle.event = torch.cuda.Event(blocking=True)
                handle.event.record(self.stream)
            else:
                handle.outcome = StepOutcome([] if tokens is None else tokens.tolist(),
                                         {i: row.float().numpy().copy() for i, row in scores}, exports)
        c = self._counters
        c["steps"] += 1
        c["decode_rows"] += len(step.rows)
        c["prefill_tokens"] += sum(len(chunk.ids) for chunk in step.chunks)
        c["blocks_restored"] += len(step.restores)
        c["blocks_kept"] += len(step.keeps)
        c["blocks_exported"] += len(step.exports)
        return handle

    def collect(self, handle: _Launched) -> StepOutcome:
        if handle.outcome is not None:
            return handle.outcome
        handle.event.synchronize()  # blocking event: sleeps, without the GIL
        return StepOutcome([] if handle.tokens is None else handle.tokens.tolist(),
                       {i: t.numpy() for i, t in handle.scores.items()}, handle.exports)

    # -- prefix blocks -----------------------------------------------------------------------------------

    def block_bytes(self, tokens: int) -> int:
        return self.arch.kv_bytes_per_token(self.dtype) * tokens

    def open_blocks(self, tokens: int, budget_bytes: int) -> int:
        count = budget_bytes // self.block_bytes(tokens)
        arch = self.arch
        self.block_tokens = tokens
        self._block_shape = (2, arch.layers, arch.kv_heads, tokens, arch.head_dim)
        self.blocks = torch.empty((count, *self._block_shape), dtype=self.dtype, device=self.torch_device) \
            if count else None
        return count

    def host_block(self, data) -> torch.Tensor:
        """A copy of a block's bytes, in pinned memory on a GPU host (its copy to the device then does not
        wait for the host)."""
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size != self.block_bytes(self.block_tokens):
            raise ValueError(f"a block of {raw.size} bytes, this decoder's hold {self.block_bytes(self.block_tokens)}")
        block = torch.empty(raw.size, dtype=torch.uint8, pin_memory=self.stream is not None)
        block.numpy()[:] = raw
        return block.view(self.dtype).view(self._block_shape)

    def host_bytes(self, block: torch.Tensor) -> memoryview:
        return memoryview(block.view(torch.uint8).numpy()).cast("B")

    def _span(self, slot: int, start: int):
        end = start + self.block_tokens
        return self.keys[:, slot, :, start:end], self.values[:, slot, :, start:end]

    def _exports(self, wanted: list[tuple[int, object]]) -> tuple[list, torch.cuda.Event | None]:
        """Memory blocks copied out to host memory: (tag, host block) each, and on a GPU the event that
        marks the copies' end. There they run on a stream of their own, beside the step's compute, from the
        state the earlier steps left; only the step's keeps wait for them."""
        if not wanted:
            return [], None
        if self.stream is None:
            return [(tag, self.blocks[index].clone()) for index, tag in wanted], None
        self._copies.wait_stream(self.stream)
        out = []
        with torch.cuda.stream(self._copies):
            for index, tag in wanted:
                host = torch.empty(self._block_shape, dtype=self.dtype, pin_memory=True)
                host.copy_(self.blocks[index], non_blocking=True)
                out.append((tag, host))
            done = torch.cuda.Event()
            done.record(self._copies)
        return out, done

    def _restore_all(self, restores) -> None:
        """Each run of consecutive blocks of one slot from device memory in one gather and two copies;
        host blocks one by one (each its own copy from pinned memory)."""
        run: list = []
        for restore in sorted(restores, key=lambda r: (r.slot, r.start)):
            if isinstance(restore.source, int):
                if run and (run[-1].slot != restore.slot or run[-1].start + self.block_tokens != restore.start):
                    self._restore_run(run)
                    run = []
                run.append(restore)
                continue
            keys, values = self._span(restore.slot, restore.start)
            keys.copy_(restore.source[0], non_blocking=True)
            values.copy_(restore.source[1], non_blocking=True)
        if run:
            self._restore_run(run)

    def _restore_run(self, run) -> None:
        index = torch.tensor([r.source for r in run], dtype=torch.int64).to(self.torch_device, non_blocking=True)
        blocks = self.blocks.index_select(0, index)  # [n, 2, layers, kv, tokens, d]
        n, tokens = len(run), self.block_tokens
        joined = blocks.permute(1, 2, 3, 0, 4, 5).reshape(2, self.arch.layers, self.arch.kv_heads, n * tokens, -1)
        start = run[0].start
        self.keys[:, run[0].slot, :, start:start + n * tokens].copy_(joined[0])
        self.values[:, run[0].slot, :, start:start + n * tokens].copy_(joined[1])

    def reserve_host(self, count: int) -> None:
        """Makes `count` blocks of pinned host memory once (the allocator keeps them for reuse): exports
        and disk reads then take pinned memory without pinning new pages while serving."""
        if self.stream is None or count <= 0:
            return
        started = time.perf_counter()
        held = [torch.empty(self._block_shape, dtype=self.dtype, pin_memory=True) for _ in range(count)]
        del held
        log.info("reserved %d pinned host blocks (%.0f MiB) in %.1f s", count,
                 count * self.block_bytes(self.block_tokens) / 2**20, time.perf_counter() - started)

    def _keep(self, keep) -> None:
        keys, values = self._span(keep.slot, keep.start)
        self.blocks[keep.block, 0].copy_(keys)
        self.blocks[keep.block, 1].copy_(values)

    def _decode(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        rows = step.rows
        width = _first_at_least(self.batches, max(r.slot for r in rows) + 1)
        span = _first_at_least(self.spans, max(r.position for r in rows) + 1)
        given = [(r.slot, r.token) for r in rows if r.token is not None]
        host = np.full(width + 2 * len(given), self.scratch, dtype=np.int64)
        for r in rows:
            host[r.slot] = r.position
        if given:
            host[width:] = np.asarray(given, dtype=np.int64).T.reshape(-1)
        staged = self._stage(host)
        self.positions[:width].copy_(staged[:width])
        if given:
            self.tokens.index_copy_(0, staged[width:width + len(given)], staged[width + len(given):])
        graph = self._graphs.get((width, span))
        if graph is not None:
            graph[0].replay()
            logits = graph[1]
            self._counters["graph_replays"] += 1
        else:
            logits = self._decode_forward(width, span)
        slots = self._stage(np.fromiter((r.slot for r in rows), dtype=np.int64, count=len(rows)))
        return self.tokens[slots], logits

    def _decode_forward(self, width: int, span: int) -> torch.Tensor:
        logits = self.module(self.tokens[:width, None], self.positions[:width, None], self.keys, self.values,
                             None, span)
        self.tokens[:width] = logits.argmax(-1)
        return logits

    def _prefill(self, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        chunks = step.chunks
        n = len(chunks)
        width = max(len(c.ids) for c in chunks)
        end = max(c.start + len(c.ids) for c in chunks)
        if n == 1 and self.pipelined and width <= CHUNK_WIDTHS[-1]:
            return self._prefill_one(chunks[0], _first_at_least(CHUNK_WIDTHS, width), _first_at_least(self.spans, end))
        span = min(self.context, -(-end // PREFILL_ALIGN) * PREFILL_ALIGN)
        host = np.zeros(2 * n * width + 2 * n, dtype=np.int64)
        ids = host[:n * width].reshape(n, width)
        positions = host[n * width:2 * n * width].reshape(n, width)
        positions.fill(self.scratch)
        for i, c in enumerate(chunks):
            ids[i, :len(c.ids)] = c.ids
            positions[i, :len(c.ids)] = np.arange(c.start, c.start + len(c.ids))
        host[2 * n * width:2 * n * width + n] = [c.slot for c in chunks]
        host[2 * n * width + n:] = [len(c.ids) - 1 for c in chunks]
        staged = self._stage(host)
        slots = staged[2 * n * width:2 * n * width + n]
        logits = self.module(staged[:n * width].view(n, width), staged[n * width:2 * n * width].view(n, width),
                             self.keys, self.values, slots, span, staged[2 * n * width + n:])
        chosen = logits.argmax(-1)
        self.tokens.index_copy_(0, slots, chosen)
        return chosen, logits

    def _prefill_one(self, chunk, width: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's only chunk, padded to `width` (padding reads token 0 at the scratch position), over the
        span class `span`: replayed from its graph where one was captured, else eager with the same shapes
        (so that both compute the same)."""
        length = len(chunk.ids)
        host = np.zeros(2 * width + 2, dtype=np.int64)
        host[:length] = chunk.ids
        host[width:2 * width] = self.scratch
        host[width:width + length] = np.arange(chunk.start, chunk.start + length)
        host[2 * width:] = (chunk.slot, length - 1)
        staged = self._stage(host)
        graph = self._chunk_graphs.get((width, span))
        if graph is not None:
            self._chunk_inputs[width].copy_(staged)
            graph[0].replay()
            logits = graph[1]
            self._counters["chunk_graph_replays"] += 1
        else:
            logits = self._chunk_forward(staged, width, span)
        chosen = logits.argmax(-1)
        self.tokens.index_copy_(0, staged[2 * width:2 * width + 1], chosen)
        return chosen, logits

    def _chunk_forward(self, inputs: torch.Tensor, width: int, span: int) -> torch.Tensor:
        return self.module(inputs[:width].view(1, width), inputs[width:2 * width].view(1, width), self.keys,
                           self.values, inputs[2 * width:2 * width + 1], span, inputs[2 * width + 1:])

    def _stage(self, host: np.ndarray) -> torch.Tensor:
        """Host int64 values on the device, through pinned memory on a GPU (the copy does not wait)."""
        if self.stream is None:
            return torch.from_numpy(host)
        pinned = torch.empty(host.shape, dtype=torch.int64, pin_memory=True)
        pinned.numpy()[:] = host
        return pinned.to(self.torch_device, non_blocking=True)

    # -- CUDA graphs -------------------------------------------------------------------------------------

    def _capture_all(self) -> None:
        """One decode graph per (batch class, span class) and one prompt chunk graph per (width class, span
        class), largest first: later, smaller captures reuse the pool's blocks. Idle rows' and padding
        positions are scratch, so the warm-up and capture runs write nothing real."""
        started = time.perf_counter()
        with torch.inference_mode():
            side = torch.cuda.Stream(self.torch_device)
            side.wait_stream(torch.cuda.current_stream(self.torch_device))
            with torch.cuda.stream(side):  # library handles and workspaces exist before capture
                for _ in range(2):
                    self._decode_forward(self.batches[-1], self.spans[-1])
            torch.cuda.current_stream(self.torch_device).wait_stream(side)
            pool = torch.cuda.graph_pool_handle()
            for span in reversed(self.spans):
                for width in reversed(self.batches):
                    self._graphs[(width, span)] = capture(partial(self._decode_forward, width, span), pool, self.stream)
            # Single prompt chunks: their inputs all scratch (token 0 at the scratch position of slot 0).
            side.wait_stream(torch.cuda.current_stream(self.torch_device))
            for width in reversed(CHUNK_WIDTHS):
                inputs = self._chunk_inputs[width] = torch.zeros(2 * width + 2, dtype=torch.int64,
                                                                 device=self.torch_device)
                inputs[width:2 * width] = self.scratch
                for span in reversed(self.spans):
                    with torch.cuda.stream(side):  # its kernels' plans and workspaces exist before capture
                        self._chunk_forward(inputs, width, span)
                    self.stream.wait_stream(side)
                    self._chunk_graphs[(width, span)] = capture(partial(self._chunk_forward, inputs, width, span),
                                                                pool, self.stream)
        torch.cuda.synchronize(self.torch_device)
        self.capture_s = time.perf_counter() - started
        log.info("captured %d decode graphs (%d batch classes x %d spans) and %d prompt chunk graphs in %.1f s",
                 len(self._graphs), len(self.batches), len(self.spans), len(self._chunk_graphs), self.capture_s)

    # -- the rest ----------------------------------------------------------------------------------------

    def device_memory_bytes(self) -> int:
        return self._memory

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def raw_decode_loop(self, rows: int, steps: int, position: int) -> float:
        """Seconds for `steps` decode steps of `rows` sequences at `position` onwards, back to back, each
        feeding its argmax to the next, with nothing else between them: the engine's own ceiling, which
        the benchmarks compare the server with. Writes the first `rows` slots."""
        if position + steps > self.context:
            raise ValueError(f"{position} + {steps} steps exceed the context ({self.context})")
        width = _first_at_least(self.batches, rows)
        with torch.inference_mode(), _on(self.stream):
            self.positions.fill_(self.scratch)
            self.positions[:rows] = position
            self._sync()
            started = time.perf_counter()
            for at in range(position, position + steps):
                graph = self._graphs.get((width, _first_at_least(self.spans, at + 1)))
                if graph is not None:
                    graph[0].replay()
                else:
                    self._decode_forward(width, _first_at_least(self.spans, at + 1))
                self.positions[:rows] += 1
            self._sync()
            elapsed = time.perf_counter() - started
            self.positions.fill_(self.scratch)
        return elapsed

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def load(directory: Path, slots: int, context: int, device: str, *, graphs: bool | None = None) -> TorchDecoder:
    """The decoder of a model version directory (decoder.json, decoder.safetensors) on `device` ("cuda" or
    "cpu"): bf16 on a GPU, fp32 on a CPU."""
    from safetensors import safe_open

    arch = LlamaArchitecture.read(directory)
    if context > arch.max_positions:
        raise ValueError(f"generate.context_length {context} exceeds the {arch.max_positions} positions the "
                         "weights know")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    started = time.perf_counter()
    with safe_open(str(directory / DECODER_WEIGHTS_FILE), framework="pt", device=device) as f:
        state = {name: f.get_tensor(name) for name in f.keys()}
    module = Llama.from_hf_state(arch, state, dtype, device)
    del state
    loaded = time.perf_counter() - started
    kv = 2 * arch.layers * slots * arch.kv_heads * (context + 1) * arch.head_dim * module.embed.element_size()
    log.info("decoder %s: %.1fM parameters in %s on %s (%.1f s); key/value pool %d slots x %d positions (%.0f MiB)",
             directory, arch.parameters() / 1e6, str(dtype).removeprefix("torch."), device, loaded, slots, context,
             kv / 2**20)
    return TorchDecoder(module, slots, context, graphs=graphs)
