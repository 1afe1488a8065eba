"""Chunk registry: cached chunk KV keyed by a strong hash, shared, reference-counted, LRU-evicted.

key = sha256(model fingerprint, strategy, chunk token ids, [start position], [key of the
preceding chunk chain]). Every hit also compares the stored token ids, so a hash collision can
only cost a miss, never hand back another chunk's KV.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from kvdiff.engine.kv_cache import BlockPool

log = logging.getLogger(__name__)

KEYS_KEPT = 1024      # chunk keys remembered (a hit's chunk is not serialised and hashed again)


@dataclass
class CacheEntry:
    """One cached chunk: its tokens, where its KV lives, and how it was encoded."""

    key: str
    token_ids: tuple[int, ...]
    blocks: list[int]
    slots: torch.Tensor
    encoded_start: int            # position RoPE encoded the first token at
    prefill_id: int               # engine forward that computed it
    nbytes: int
    refcount: int = 0
    host_slots: np.ndarray | None = None   # `slots` on the host (a hit's block table needs no device read)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class RegistryStats:
    """Counters since the registry was made."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0        # tokens served from the cache
    stored_tokens: int = 0        # tokens whose KV was computed and stored
    evictions: int = 0
    collisions: int = 0
    entries: int = 0
    bytes: int = 0


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ChunkRegistry:
    """Cached chunks in a block pool, evicted least-recently-used (unreferenced only) under a byte budget."""

    def __init__(self, pool: BlockPool, bytes_per_block: int, budget_bytes: int,
                 digest: Callable[[bytes], str] = _sha256):
        self.pool = pool
        self.bytes_per_block = bytes_per_block
        self.budget_bytes = budget_bytes
        self.digest = digest
        self.stats = RegistryStats()
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._keys: dict[tuple, str] = {}       # key()'s arguments (and digest) -> key, oldest first
        pool.reclaim = self._reclaim_blocks

    def key(self, fingerprint: str, strategy: str, token_ids: Sequence[int], parent: str | None = None,
            start: int | None = None) -> str:
        """The cache key of a chunk (`parent`: key of the preceding chain, `start`: position if it matters);
        the last KEYS_KEPT are remembered by their arguments (a pure function of them and the digest)."""
        args = (self.digest, fingerprint, strategy, tuple(token_ids), parent, start)
        key = self._keys.get(args)
        if key is None:
            key = self._keys[args] = self.digest(json.dumps([fingerprint, strategy, list(token_ids), parent,
                                                             start]).encode())
            if len(self._keys) > KEYS_KEPT:
                del self._keys[next(iter(self._keys))]
        return key

    def lookup(self, key: str, token_ids: Sequence[int]) -> CacheEntry | None:
        """The entry for `key` if its tokens match; counts a hit or a miss."""
        entry = self._entries.get(key)
        if entry is not None and entry.token_ids != tuple(token_ids):
            self.stats.collisions += 1
            log.warning("hash collision on chunk key %s: tokens differ, treated as a miss", key[:12])
            entry = None
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        self.stats.reused_tokens += entry.num_tokens
        return entry

    def has_key(self, key: str) -> bool:
        return key in self._entries

    def insert(self, key: str, token_ids: Sequence[int], encoded_start: int, prefill_id: int) -> CacheEntry:
        """A new entry with freshly allocated blocks (its KV is written by the caller's forward)."""
        n = len(token_ids)
        nblocks = self.pool.blocks_for(n)
        nbytes = nblocks * self.bytes_per_block
        self._evict_until(self.budget_bytes - nbytes)
        blocks = self.pool.allocate(nblocks)
        host = self.pool.host_slots(blocks, n)
        entry = CacheEntry(key, tuple(token_ids), blocks, torch.from_numpy(host).to(self.pool.device), encoded_start,
                           prefill_id, nbytes, host_slots=host)
        self._entries[key] = entry
        self.stats.stored_tokens += n
        self.stats.entries = len(self._entries)
        self.stats.bytes += nbytes
        return entry

    def acquire(self, entry: CacheEntry) -> None:
        entry.refcount += 1

    def release(self, entry: CacheEntry) -> None:
        if entry.refcount <= 0:
            raise ValueError(f"release of unreferenced chunk entry {entry.key[:12]}")
        entry.refcount -= 1

    def discard(self, entry: CacheEntry) -> None:
        """Drop an entry whose KV was never completed (its forward failed)."""
        if self._entries.get(entry.key) is entry:
            self._remove(entry)

    def entries(self) -> list[CacheEntry]:
        """Entries from least to most recently used."""
        return list(self._entries.values())

    def _remove(self, entry: CacheEntry) -> None:
        del self._entries[entry.key]
        self.pool.free(entry.blocks)
        self.stats.entries = len(self._entries)
        self.stats.bytes -= entry.nbytes

    def _evict_one(self) -> bool:
        for entry in self._entries.values():
            if entry.refcount == 0:
                self._remove(entry)
                self.stats.evictions += 1
                log.debug("evicted chunk %s (%d tokens)", entry.key[:12], entry.num_tokens)
                return True
        return False

    def _evict_until(self, max_bytes: int) -> None:
        while self.stats.bytes > max_bytes and self._evict_one():
            pass

    def _reclaim_blocks(self, missing: int) -> None:
        target = self.pool.free_blocks + missing
        while self.pool.free_blocks < target and self._evict_one():
            pass
