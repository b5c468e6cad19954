"""CUDA graphs for decode batches (of the model, and of an MTP draft).

One graph per capture size, all sharing one memory pool and one set of static input
buffers. A decode batch of ``n`` rows is padded to the next captured size: padded rows
write no KV (slot -1) and attend to one token of block 0; their outputs are dropped.
The attention kernel's launch grid is fixed at capture, so it is captured for the longest
context (``max_model_len``) and reads each row's real length from ``seq_lens``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from atom.forward_context import AttentionMetadata, get_forward_context, set_forward_context

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    @torch.inference_mode()  # inference tensors, as the warm-up's inputs were: else the compiled forward recompiles
    def __init__(self, forward: Callable, capture_sizes: list[int], max_model_len: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, hidden_inputs: int = 0):
        self.forward = forward  # the (possibly compiled) model forward
        self.sizes = sorted(set(capture_sizes))
        self.max_model_len = max_model_len
        max_bs = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.output = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        # per-token hidden-state inputs after ids and positions (an MTP draft's previous hidden states)
        self.hidden_inputs = [torch.zeros_like(self.output) for _ in range(hidden_inputs)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_seqlen_q=1, max_seqlen_k=self.max_model_len, num_decode_tokens=bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        torch.cuda.empty_cache()  # the warm-up's cached blocks, else their release shows as negative graph memory
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        first = None  # seconds of the first warm-up forward (compilation, if any, shows there)
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
            meta = self._meta(bs)
            layers = get_forward_context().attn_layers
            inputs = (self.input_ids[:bs], self.positions[:bs], *(h[:bs] for h in self.hidden_inputs))
            with set_forward_context(meta, self.positions[:bs], layers):
                self.output[:bs] = self.forward(*inputs)  # warm-up
                if first is None:
                    torch.cuda.synchronize()
                    first = time.perf_counter() - start
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.output[:bs] = self.forward(*inputs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        # the graphs' memory pool (and any warm-up allocations kept), as vLLM reports it
        used = (free_before - torch.cuda.mem_get_info()[0]) / (1 << 30)
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s (the first warm-up forward %.1f s), %.2f GiB",
                    len(self.graphs), self.sizes, time.perf_counter() - start, first, used)  # fmt: skip

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return meta.max_seqlen_q == 1 and num_tokens <= self.sizes[-1] and meta.block_tables.shape[1] <= \
            self.block_tables.shape[1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            *hidden: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Replay the graph for ``meta``'s decode batch (the caller's forward context is unused)."""
        n = input_ids.shape[0]
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        for buf, h in zip(self.hidden_inputs, hidden, strict=True):
            buf[:n] = h
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.seq_lens[:n] = meta.seq_lens
        self.seq_lens[n:bs] = 1
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width] = meta.block_tables
        self.block_tables[n:bs] = 0
        self.graphs[bs].replay()
        return self.output[:n]
