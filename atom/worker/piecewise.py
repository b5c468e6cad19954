"""Piecewise CUDA graphs for mixed (prefill + decode) batches, vLLM's PIECEWISE half of
FULL_AND_PIECEWISE.

A batch that is not pure decode cannot be one CUDA graph: its attention launches depend on the
batch's sequences. Without graphs its host time is the launch of every kernel in Python (on an
H100 host about 40 ms a step for Qwen3-8B whatever the batch, more than the GPU time of a
1024-token prefill: docs/performance.md). So the model is traced once by Dynamo, its graph is
split at the attention ops (``atom::unified_attention``, ``atom::mla_attention``), and each
piece between two attention ops is captured as a CUDA graph per padded token count; attention
runs eagerly between the replays, on the batch's real tokens only.

A piece's inputs must sit where they sat at capture: the model inputs are this runner's static
buffers, the weights do not move, and everything else is an earlier piece's output, kept at its
capture address (the attention ops write into an output the piece before them allocated). All
pieces of all sizes share one memory pool; a piece keeps only weak references to its outputs,
so sizes reuse each other's memory (one size runs at a time), as vLLM's CUDAGraphWrapper does.
"""

from __future__ import annotations

import bisect
import logging
import operator
import time
import weakref
from collections.abc import Callable

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from atom.forward_context import AttentionMetadata, set_forward_context

logger = logging.getLogger(__name__)

# the ops between which the graph is cut (they run eagerly, with each batch's metadata)
SPLIT_OPS = ("atom::unified_attention", "atom::mla_attention")


def _is_split_op(node: fx.Node) -> bool:
    """An attention op, called as ``torch.ops.atom.x`` (a packet) or as one of its overloads."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name in SPLIT_OPS
    return isinstance(target, torch._ops.OpOverload) and target._schema.name in SPLIT_OPS


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """``gm`` cut before and after each attention op: a module whose children ``submod_<i>``
    alternate between pieces and single attention ops. Returns it and the pieces' names."""
    part, parts, attention = 0, {}, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0].op != "placeholder":
            parts[node] = parts[node.args[0]]  # a tuple's items stay with their producer
        elif _is_split_op(node):
            part += 1
            parts[node] = part
            attention.add(part)
            part += 1
        else:
            parts[node] = part
    split = split_module(gm, None, lambda node: parts[node], keep_original_order=True)
    pieces = [name for name, _ in split.named_children() if int(name.rpartition("_")[2]) not in attention]
    return split, pieces


def weak_ref(x):
    """A tensor (or tuple/list of them) viewing the same memory without keeping it alive."""
    if isinstance(x, (tuple, list)):
        return type(x)(weak_ref(t) for t in x)
    if not isinstance(x, torch.Tensor) or x.numel() == 0:
        return x
    storage = x.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), x.device, storage.nbytes())
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(weak, x.storage_offset(), x.shape, x.stride())


class _Piece:
    """One piece of the split graph: runs it, or captures it for the runner's current size,
    or replays that size's graph (runs it when that size was captured by another compilation
    of the model: see ``PiecewiseGraphs.uncaptured``). Dynamo's cache holds the pieces for as
    long as the model's code lives, so a piece reaches its runner (which owns the graphs) by a
    weak reference: an engine's graphs and their memory go with it."""

    def __init__(self, module: fx.GraphModule, runner: PiecewiseGraphs):
        self.module, self.runner = module, weakref.ref(runner)

    def __call__(self, *args):
        runner = self.runner()
        size = runner.size if runner is not None else None
        if size is None:
            return self.module(*args)
        if runner.capturing:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=runner.pool)
            try:
                out = self.module(*args)
            finally:
                graph.capture_end()
            runner.graphs[self, size] = (graph, weak_ref(out))
            return out  # the real tensors, alive while later pieces of this size are captured
        entry = runner.graphs.get((self, size))
        if entry is None:
            runner.uncaptured(size)
            return self.module(*args)
        entry[0].replay()
        return entry[1]


class PiecewiseGraphs:
    """Mixed batches of up to ``max(sizes)`` tokens, padded to the next size, as CUDA graphs of
    the pieces between attention ops. ``forward(input_ids, positions)`` is the model's."""

    @torch.inference_mode()  # inference tensors, as every forward's inputs are (else Dynamo recompiles)
    def __init__(self, forward: Callable, sizes: list[int], device: torch.device):
        self.sizes = sorted(set(sizes))
        # one row more than the largest size: no input is then the whole buffer, which Dynamo
        # would guard on (``input_ids._base.size(0) == input_ids.size(0)``) and recompile for the next
        self.input_ids = torch.zeros(self.sizes[-1] + 1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.sizes[-1] + 1, dtype=torch.int64, device=device)
        self.size: int | None = None  # the size being captured or replayed; None: run the pieces as they are
        self.capturing = False
        self.pool = None
        self.compilations: list[list[_Piece]] = []  # each Dynamo compilation's pieces, in order
        self.graphs: dict[tuple[_Piece, int], tuple[torch.cuda.CUDAGraph, object]] = {}  # (piece, size) ->
        self.missed: set[int] = set()  # sizes that reached pieces without their graphs

        def model_forward(input_ids, positions):
            return forward(input_ids, positions)

        # A code object of its own: Dynamo caches compilations on the code object, so this
        # runner's stay out of the model class's cache (whose recompile limit every engine of the
        # class in the process shares) and go with the runner. The backend reaches it weakly.
        model_forward.__code__ = model_forward.__code__.replace()
        me = weakref.ref(self)
        self.forward = torch.compile(model_forward, backend=lambda gm, example_inputs: me()._split(gm), dynamic=True,
                                     fullgraph=True)  # fmt: skip

    def _split(self, gm: fx.GraphModule) -> Callable:
        split, names = split_at_attention(gm)
        pieces = [_Piece(getattr(split, name), self) for name in names]
        for name, piece in zip(names, pieces):
            split.__dict__[name] = piece  # found before the child module of the same name
        self.compilations.append(pieces)
        logger.info("piecewise CUDA graphs: the model is %d pieces between %d attention ops (compilation %d)",
                    len(names), len(list(split.children())) - len(names), len(self.compilations))
        return split

    def uncaptured(self, size: int) -> None:
        """A forward of ``size`` tokens reached pieces that were not captured for it: Dynamo
        chose another compilation of the model than at capture. Its pieces run uncaptured
        (correct, slower); said once per size."""
        if size not in self.missed:
            self.missed.add(size)
            logger.warning("piecewise CUDA graphs: %d-token batches reached a compilation of the model without "
                           "graphs for them; they run uncaptured", size)

    @torch.inference_mode()
    def capture(self, layers: dict, meta_for: Callable[[int], AttentionMetadata]) -> None:
        """Capture every size, largest first (smaller ones reuse its pool memory); each size runs
        once uncaptured first so that every kernel is compiled and loaded before its capture."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # cached blocks released during the capture would hide the graphs' memory
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(torch.cuda.Stream()):  # captures cannot use the legacy default stream
            for size in reversed(self.sizes):
                ids, pos = self.input_ids[:size], self.positions[:size]
                with set_forward_context(meta_for(size), pos, layers):
                    self.forward(ids, pos)
                    self.size, self.capturing = size, True
                    try:
                        self.forward(ids, pos)
                    finally:
                        self.size, self.capturing = None, False
            torch.cuda.synchronize()
        if not self.compilations:  # Dynamo did not compile the model (it ran as it is)
            logger.warning("piecewise CUDA graphs: the model did not compile; mixed batches run without graphs")
            return
        # A graph's first launch uploads it (ms), and one launched into another stream may be
        # uploaded again: replay every size once here, on the stream the steps replay on
        for size in self.sizes:
            with set_forward_context(meta_for(size), self.positions[:size], layers):
                self.run(self.input_ids[:size], self.positions[:size])
        torch.cuda.synchronize()
        used = (free_before - torch.cuda.mem_get_info()[0]) / (1 << 30)
        logger.info("captured piecewise CUDA graphs for mixed batches of %d-%d tokens (%d sizes, %d pieces, %d "
                    "compilation(s)) in %.1f s, %.2f GiB", self.sizes[0], self.sizes[-1], len(self.sizes),
                    len(self.compilations[-1]), len(self.compilations), time.perf_counter() - start, used)

    def can_run(self, num_tokens: int) -> bool:
        return bool(self.compilations) and 0 < num_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's hidden states for a batch (in the caller's forward context, whose metadata
        covers the real tokens): the inputs padded to the next size, the pieces replayed."""
        n = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.size = size
        try:
            hidden = self.forward(self.input_ids[:size], self.positions[:size])
        finally:
            self.size = None
        return hidden[:n]
