"""Paged KV blocks: reference counts, and a prefix cache keyed by a chained hash.

A full block's hash covers its tokens and the hash of the block before it, so equal
hashes mean equal prefixes (the token ids are compared too, against collisions). Freed
blocks keep their contents and hash; they sit in an LRU free list and are reused by a
later request with the same prefix, or evicted (oldest first) when a new block is needed.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from atom.engine.sequence import Sequence


def hash_block(token_ids: list[int] | tuple[int, ...], parent_hash: int) -> int:
    h = xxhash.xxh3_64()
    h.update(parent_hash.to_bytes(8, "little", signed=True))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest() & 0x7FFFFFFFFFFFFFFF


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in LRU order (front = evicted first); values unused
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def capacity(self) -> int:
        """Tokens the KV cache holds: the one place KV capacity is computed."""
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # prefix cache
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding a prefix of ``seq``'s tokens. Never the whole sequence: its last
        token must be computed to produce logits."""
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        hits, parent = [], -1
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash_block(tokens, parent)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += len(hits) * self.block_size
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        # cached blocks with no owner sit in the free list but will not be available
        reclaimed = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed_after(seq, num_new_tokens, len(cached))
        return needed <= self.num_free_blocks - reclaimed

    def blocks_needed_after(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int) -> int:
        if not num_cached_blocks:
            return self.blocks_needed(seq, num_new_tokens)
        total = num_cached_blocks * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - num_cached_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> None:
        """Attach ``cached`` prefix blocks (first scheduling only), then grow the block
        table to cover ``num_new_tokens`` more computed tokens. The scheduler, the one
        writer of ``num_computed_tokens``, counts the cached tokens as computed."""
        if cached:
            assert not seq.block_table, "cached prefix blocks attach to an empty sequence"
            for block_id in cached:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_blocks[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
                seq.block_hashes.append(block.hash)
        needed = self.blocks_needed_after(seq, num_new_tokens, len(cached))
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evict its cached contents
        block.hash, block.token_ids, block.ref_count = -1, (), 1
        return block_id

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the hashes of blocks that the first ``num_tokens`` tokens (computed, and
        known on the host) fill."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = seq.block_hashes[-1] if seq.block_hashes else -1
            h = hash_block(tokens, parent)
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block.setdefault(h, block.block_id)
            seq.block_hashes.append(h)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; the tail is freed first so that it is evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"double free of block {block_id}"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
