"""The prefix key/value cache of one generative model version in a worker: prompt blocks computed once and
reused by every later request that starts with the same tokens, across three tiers.

Index. A prompt is cut into blocks of `prefix_cache.block_tokens` tokens; block i's key is a hash of
block i-1's key, the block's token ids and a namespace: the model, version, the decoder's key/value form
(runtime and precision), the block size, and the request's tenant. Tenants never reach each other's
blocks, except the blocks within a system prompt that the model's config makes public (the frontend
says how many leading tokens that is: ComputeItem.public_prefix), whose namespace names no tenant. The
hash follows the store's namespace id of (tenant, model, version) (public blocks: the tenant ""), as L1's
keys do, so Invalidate finds a tenant's, a model's or a version's blocks in every tier (erase). A
request reuses its longest run of cached blocks from its first token, at most all but its last token
(the step that reads the rest gives the first answer token), and the scheduler reads only the rest.
Blocks of what a generation computed (its prompt once read, then prompt and answer once it ended:
"prefix-output", the next turn of a conversation starts with them) are kept.

Tiers, each bounded, each a miss on failure:
- memory: the decoder's own blocks (device memory on a GPU worker, `device_fraction` of what is free
  after loading; host memory on a CPU worker, `host_mb`), an LRU. A block evicted from it is demoted;
- host (GPU workers): pinned host memory up to `host_mb`, an LRU; evicted blocks are demoted to disk;
- disk: the host's LMDB block store (server/worker/prefix/prefix_disk.py), written behind by a thread, read
  back by a pool of threads, checked (the store's checksums, sealing when encryption is on): shared by
  the host's workers, kept across restarts, bounded by `kv.budget_mb`. A request whose prefix continues
  on disk waits while those blocks are read into host memory, then restores them.
The scheduler (server/worker/generation/scheduler.py) is the only caller, on the event loop, but for erase (the
worker's Invalidate, on the event loop too); the decoder's copies run in its steps
(server/engines/decoding.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import time
from collections import Counter, OrderedDict
from functools import partial

from cachestore.keys import KEY_BYTES, NS_ID_BYTES, Namespace, Selector, namespace
from server.engines.decoding import Decoder, Keep, Restore, Step
from server.shared.generation_spec import PrefixSpec

log = logging.getLogger("infercache.prefix")

TIERS = ("memory", "host", "disk")
MAX_DISK_READS = 64  # blocks one request reads from disk at once


class PrefixCache:
    def __init__(self, spec: PrefixSpec, decoder: Decoder, model: str, version: str, *, memory_bytes: int,
                 host_bytes: int, disk=None) -> None:
        """memory_bytes: the decoder's block memory; host_bytes: pinned host blocks beside it (0 on a CPU
        worker, whose memory tier is host memory); disk: the host's BlockStore (server/worker/prefix/prefix_disk.py),
        or None."""
        self.decoder = decoder
        self.block = spec.block_tokens
        self.model, self.version = model, version
        self.kv_form = f"{decoder.runtime}-{decoder.precision}"
        self.capacity = decoder.open_blocks(self.block, memory_bytes)
        per = decoder.block_bytes(self.block)
        self.host_capacity = host_bytes // per if per else 0
        self.memory: OrderedDict[bytes, int] = OrderedDict()   # key -> memory block, least recently used first
        self.free = list(range(self.capacity))
        self.host: OrderedDict[bytes, object] = OrderedDict()  # key -> host block
        self.writing: dict[bytes, object] = {}                 # handed to the disk tier, not committed yet
        self.exporting: set[bytes] = set()                     # evicted from memory, copied out by a step
        self.disk = disk if spec.disk else None
        self.counters: Counter[str] = Counter()  # (the scheduler's task is the only writer)
        self._namespaces: dict[str | None, tuple[bytes, bytes]] = {}  # tenant -> (hash namespace, store ns id)
        self._spaces: dict[bytes, Namespace] = {}                      # store ns id -> its namespace
        self.erasures = 0  # erase calls that named this version: a generation looked up before one keeps nothing
        self._kept_now: set[bytes] = set()  # keys the step being planned keeps (see planning)
        decoder.reserve_host(self.host_capacity + 2 * MAX_DISK_READS)  # and what exports and disk reads hold
        log.info("%s version %s: prefix blocks of %d tokens (%.1f MiB each): %d in %s memory, %d in host memory%s",
                 model, version, self.block, per / 2**20, self.capacity, decoder.device, self.host_capacity,
                 ", then disk" if self.disk else "")

    # -- keys ----------------------------------------------------------------------------------------------

    def _namespace(self, tenant: str | None) -> tuple[bytes, bytes]:
        """(the hash's namespace, the store's namespace id) of a tenant's blocks (None: public blocks)."""
        found = self._namespaces.get(tenant)
        if found is None:
            parts = [self.model, self.version, self.kv_form, str(self.block), "public" if tenant is None else "tenant",
                     tenant or ""]
            ns = namespace(tenant or "", self.model, self.version)
            found = self._namespaces[tenant] = (hashlib.blake2b("\0".join(parts).encode(), digest_size=16).digest(),
                                                ns.ns_id)
            self._spaces[ns.ns_id] = ns
        return found

    def keys(self, generation, tokens: list[int], count: int) -> list[bytes]:
        """The keys of the first `count` blocks of `tokens` (extending the generation's, computed once)."""
        keys = generation.block_keys
        public = generation.item.public_prefix
        for i in range(len(keys), count):
            ids = tokens[i * self.block:(i + 1) * self.block]
            tenant = None if (i + 1) * self.block <= public else generation.item.tenant
            hashed, ns_id = self._namespace(tenant)
            digest = hashlib.blake2b(hashed, digest_size=KEY_BYTES - NS_ID_BYTES)
            digest.update(keys[i - 1] if i else b"")
            digest.update(struct.pack(f"<{len(ids)}i", *ids))
            keys.append(ns_id + digest.digest())
        return keys[:count]

    # -- reuse ---------------------------------------------------------------------------------------------

    def lookup(self, generation, wake) -> list[Restore] | None:
        """Restores of the generation's longest cached prefix into its slot (its `fed` moves past them),
        or None while blocks it needs are read from disk (wake() is called once they are; look up again)."""
        if generation.loading:
            return None
        if generation.loaded is None:
            generation.erasures = self.erasures
        elif generation.erasures != self.erasures:
            generation.loaded = {}  # read before an erasure: not restored
        prompt = generation.prompt
        count = (len(prompt) - 1) // self.block
        keys = self.keys(generation, prompt, count)
        loaded = generation.loaded or {}
        restores, tiers = [], Counter()
        for i, key in enumerate(keys):
            source, tier = self._find(key, loaded)
            if source is None:
                if self.disk is not None and generation.loaded is None and self.disk.contains(key):
                    generation.loading = True
                    asyncio.get_running_loop().create_task(
                        self._read_disk(generation, keys[i:i + MAX_DISK_READS], wake))
                    return None
                break
            restores.append(Restore(generation.slot, i * self.block, source))
            tiers[tier] += 1
        generation.loaded = None
        generation.fed = len(restores) * self.block
        generation.reused_from = max(tiers, key=TIERS.index) if tiers else "none"
        c = self.counters
        c["prefix_tokens_queried"] += len(prompt)
        for tier, blocks in tiers.items():
            c[f"prefix_tokens_{tier}"] += blocks * self.block
        return restores

    def _find(self, key: bytes, loaded: dict) -> tuple[object, str]:
        if key in self._kept_now:
            return None, ""  # its contents exist once the step being planned has computed
        if (index := self.memory.get(key)) is not None:
            self.memory.move_to_end(key)
            return index, "memory"
        if (block := self.host.get(key)) is not None:
            self.host.move_to_end(key)
            return block, "host"
        if (block := self.writing.get(key)) is not None:
            return block, "host"
        if (block := loaded.get(key)) is not None:
            return block, "disk"
        return None, ""

    async def _read_disk(self, generation, keys: list[bytes], wake) -> None:
        """Reads the blocks of `keys`, in parallel, keeping those in order up to the first that is not
        there or does not read back as a block (a miss from there on); then wakes the scheduler."""
        loop = asyncio.get_running_loop()
        read = partial(self.disk.read, make=self.decoder.host_block)
        started = time.perf_counter()
        try:
            blocks = await asyncio.gather(*(loop.run_in_executor(self.disk.readers, read, k) for k in keys))
        except RuntimeError:  # the pool shut down: the worker is stopping
            blocks = []
        loaded = {}
        for key, block in zip(keys, blocks):
            if block is None:
                break
            loaded[key] = block
        self.counters["prefix_disk_reads"] += len(loaded)
        self.counters["prefix_disk_read_us"] += int((time.perf_counter() - started) * 1e6)
        generation.loaded, generation.loading = loaded, False
        wake()

    # -- keeping -------------------------------------------------------------------------------------------

    def planning(self) -> None:
        """A new step is being planned: blocks it keeps cannot be evicted again until it is launched (their
        contents exist only once the step has computed; an export at its start would copy the old)."""
        self._kept_now.clear()

    def keep(self, generation, tokens: list[int], upto: int, step: Step) -> None:
        """Blocks of `tokens` (what the generation's slot holds) within its first `upto` positions that no
        tier holds yet, kept from its slot in `step` (after the step computes), evicting what must go."""
        if generation.erasures != self.erasures:
            return  # looked up before an erasure: what it holds may be what was erased
        count = min(upto, len(tokens)) // self.block
        keys = self.keys(generation, tokens, count)
        for i in range(generation.kept, count):
            key = keys[i]
            if key in self.memory:
                self.memory.move_to_end(key)
            else:
                index = self._free_block(step)
                if index is None:
                    return  # memory holds only this step's blocks: the rest may be kept at a later step
                self.host.pop(key, None)  # promoted
                self.memory[key] = index
                self._kept_now.add(key)
                step.keeps.append(Keep(generation.slot, i * self.block, index))
                self.counters["prefix_blocks_kept"] += 1
            generation.kept = i + 1

    def _free_block(self, step: Step) -> int | None:
        if self.free:
            return self.free.pop()
        if not self.memory or next(iter(self.memory)) in self._kept_now:
            return None  # memory holds only blocks this step keeps
        key, index = self.memory.popitem(last=False)
        self.counters["prefix_evicted_memory"] += 1
        if self.host_capacity or self.disk is not None:
            step.exports.append((index, key))  # copied out before the step overwrites it
            self.exporting.add(key)
        return index

    def exported(self, exports: list[tuple[bytes, object]]) -> None:
        """Blocks a step copied out of memory: into host memory, or on to disk."""
        for key, block in exports:
            if key not in self.exporting or key in self.memory:
                continue  # erased, or kept again, meanwhile
            self.exporting.discard(key)
            if self.host_capacity:
                self.host[key] = block
                self.counters["prefix_demoted_host"] += 1
                while len(self.host) > self.host_capacity:
                    old, old_block = self.host.popitem(last=False)
                    self.counters["prefix_evicted_host"] += 1
                    self._to_disk(old, old_block)
            else:
                self._to_disk(key, block)

    def _to_disk(self, key: bytes, block) -> None:
        if self.disk is None:
            return
        loop = asyncio.get_running_loop()
        self.writing[key] = block  # (readable from here until it is committed)
        self.counters["prefix_demoted_disk"] += 1

        def written() -> None:  # on the disk tier's writer thread
            try:
                loop.call_soon_threadsafe(self.writing.pop, key, None)
            except RuntimeError:  # the loop has closed: the worker is gone
                pass
        self.disk.write(key, self._spaces[key[:NS_ID_BYTES]], self.decoder.host_bytes(block), written)

    # -- erasure -------------------------------------------------------------------------------------------

    def erase(self, selector: Selector) -> int:
        """Invalidate: drops the blocks `selector` names from memory and host memory, and those waiting
        for the disk tier (its own erase, which the caller asks for after this, deletes them on disk); how
        many went. Generations looked up before it keep no blocks from then on, and restore none read from
        disk before it (what they hold may be what was erased)."""
        if selector.model not in (None, self.model) or selector.version not in (None, self.version):
            return 0
        self.erasures += 1
        spaces = {ns_id for ns_id, ns in self._spaces.items() if selector.matches(ns)}

        def named(key: bytes) -> bool:
            return key[:NS_ID_BYTES] in spaces and selector.key in (None, key)
        removed = 0
        for key in [k for k in self.memory if named(k)]:
            self.free.append(self.memory.pop(key))
            removed += 1
        for key in [k for k in self.host if named(k)]:
            del self.host[key]
            removed += 1
        for key in [k for k in self.writing if named(k)]:
            del self.writing[key]  # (counted by the disk tier's erase, which deletes it once it is written)
        self.exporting = {key for key in self.exporting if not named(key)}
        self.counters["prefix_erased"] += removed
        return removed

    def steps_lost(self) -> None:
        """The steps in flight were dropped (a decoder failure): their exports never come."""
        self.exporting.clear()

    # -- figures -------------------------------------------------------------------------------------------

    def gauges(self) -> dict[str, int]:
        """Bytes of blocks held, by tier (the disk tier's: the kv store's figures)."""
        per = self.decoder.block_bytes(self.block)
        return {"memory": len(self.memory) * per, "host": (len(self.host) + len(self.writing)) * per}

    def close(self) -> None:
        pass
