"""Property tests: random allocate/append/free sequences never leak or double-free a
block, and reference counts always equal the number of block tables holding a block."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from atom.engine.block_manager import BlockManager
from atom.engine.sequence import Sequence
from atom.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 24

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(0, 2)),  # prompt length, prefix family
    st.tuples(st.just("append"), st.integers(0, 50), st.integers(1, 6)),
    st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
)


def check(bm: BlockManager, live: list[Sequence]) -> None:
    refs = Counter(b for s in live for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free_blocks)
    for s in live:
        assert len(s.block_table) == -(-s.num_computed_tokens // BLOCK)
        assert len(set(s.block_table)) == len(s.block_table)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=60), st.booleans())
def test_random_operations_keep_refcounts_exact(ops, prefix_caching):
    bm = BlockManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=prefix_caching)
    live: list[Sequence] = []
    counter = 0
    for kind, a, b in ops:
        if kind == "add":
            counter += 1
            tokens = [b * 100 + i for i in range(a)]  # same family -> shared prefix
            seq = Sequence(str(counter), tokens, SamplingParams())
            cached = bm.find_cached_prefix(seq)
            n = seq.num_tokens - len(cached) * BLOCK
            if bm.can_allocate(seq, n, cached):
                bm.allocate(seq, n, cached)
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq, seq.num_computed_tokens)
                live.append(seq)
        elif kind == "append" and live:
            seq = live[a % len(live)]
            for t in range(b):
                seq.append_token(7000 + t)
            if bm.can_allocate(seq, b):
                bm.allocate(seq, b)
                seq.num_computed_tokens += b
                bm.cache_full_blocks(seq, seq.num_computed_tokens)
            else:
                del seq.token_ids[-b:]
        elif kind == "free" and live:
            bm.free(live.pop(a % len(live)))
        check(bm, live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == NUM_BLOCKS
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hit_verifies_tokens_and_evicts_lru():
    bm = BlockManager(4, BLOCK, enable_prefix_caching=True)
    a = Sequence("a", list(range(9)), SamplingParams())
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a, a.num_computed_tokens)
    full_blocks = a.block_table[:2]
    bm.free(a)
    b = Sequence("b", list(range(8)) + [99], SamplingParams())
    assert bm.find_cached_prefix(b) == full_blocks
    # a different prefix of the same length does not hit
    c = Sequence("c", list(range(1, 10)), SamplingParams())
    assert bm.find_cached_prefix(c) == []
    # filling the pool evicts the cached blocks
    d = Sequence("d", list(range(100, 116)), SamplingParams())
    bm.allocate(d, 16)
    assert bm.find_cached_prefix(b) == []
