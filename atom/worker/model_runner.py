"""Runs the model for one ``SchedulerOutput``: build inputs and the forward context, run the
model (eagerly or through a captured CUDA graph) and sample. ``launch`` queues all of it
on the device and returns a handle whose ``result()`` waits for the token ids and gives a
``RunnerOutput``, so the engine can prepare the next step meanwhile (async scheduling).

The runner imports the step messages (``atom.core_types``) and config, never the engine,
and never writes request state. A failure that belongs to one request (its seeded
generator, its logprobs) is reported in ``RunnerOutput.errors`` for that row; a device
failure raises."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from atom import ops
from atom.config import Config
from atom.core_types import PLACEHOLDER, RunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.forward_context import AttentionMetadata, set_forward_context
from atom.host_copy import to_device
from atom.layers.attention import Attention
from atom.layers.quantization.kv_cache import kv_cache_torch_dtype
from atom.model_loader.loader import load_model
from atom.spec_decode.decoder import build_spec_decoder
from atom.spec_decode.proposers import MtpProposer, SharedWeightsProposer
from atom.worker.logits_processors import process_logits
from atom.worker.logprobs import prompt_logprobs, token_logprobs, top_logprobs
from atom.worker.memory import GIB, MemorySnapshot, check_startup_memory, kv_cache_budget, no_room_message
from atom.worker.piecewise import PiecewiseGraphs
from atom.worker.profiler import start_torch_profiler
from atom.worker.sampler import SamplingTensors, sample
from atom.worker.warmup import log_late_compiles, warm_up_sampler, warmup_batches, warmup_inputs

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 2 << 30


class ModelRunner:
    def __init__(self, config: Config, tp: TPInfo = SINGLE):
        """``tp``: this rank's place in the tensor-parallel group (one rank in process by
        default); on CUDA rank ``r`` owns GPU ``r``."""
        self.config = config
        self.tp = dataclasses.replace(tp, expert_parallel=config.parallel_config.enable_expert_parallel)
        self.device = torch.device("cuda", tp.rank) if config.device.type == "cuda" and tp.size > 1 else config.device
        mc = config.model_config
        self.block_size = config.cache_config.block_size
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache_config.kv_cache_dtype, mc.dtype)
        # the same seed on every rank: all ranks sample the same tokens from the same logits
        torch.manual_seed(mc.seed)
        ops.init_device_ops(self.device)
        # the device before this engine's weights: its KV budget counts only what it adds
        self._memory_at_start = None
        if self.device.type == "cuda":
            self._memory_at_start = MemorySnapshot.take(self.device)
            check_startup_memory(self._memory_at_start, config.cache_config.gpu_memory_utilization)
        self.model = load_model(mc, self.device, self.tp)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.attn_layer_map = {m.prefix: m for m in self.attn_layers}
        self.forward = self._maybe_compile()
        # speculative decoding (None without it); a draft with its own attention layers
        # gets KV cache beside the target's
        self.spec = build_spec_decoder(config, self.model, self.forward, self.device, self.tp)
        self.attn_layers += self.spec.attn_layers if self.spec is not None else []
        self.kv_cache: torch.Tensor | None = None
        self.generators: dict[str, torch.Generator] = {}
        self.graph_runner = None  # full CUDA graphs of decode batches
        self.piecewise: PiecewiseGraphs | None = None  # piecewise ones of mixed batches
        # the last launched step's sampled tokens (device) and their row by request id,
        # which the next step's placeholder tokens read (async scheduling)
        self._last_sampled: torch.Tensor | None = None
        self._last_sampled_rows: dict[str, int] = {}
        self.profiler: torch.profiler.profile | None = None

    # profiling (serving guide section 5)
    def start_profile(self) -> None:
        if self.profiler is not None:
            raise RuntimeError("the profiler is already running")
        pc = self.config.parallel_config  # one directory per rank, and per replica under -dp
        name = f"rank_{self.tp.rank}"
        name = f"dp_{pc.data_parallel_rank}_{name}" if pc.data_parallel_size > 1 else name
        self.profiler = start_torch_profiler(self.config.torch_profiler_dir, name, self.device)

    def stop_profile(self) -> None:
        if self.profiler is None:
            raise RuntimeError("the profiler is not running")
        self.profiler.stop()
        self.profiler = None

    # KV cache
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, from each layer's per-token cache shape (MLA
        keeps one latent per token, so it fits many more tokens than per-head K/V)."""
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return sum(math.prod(a.kv_cache_shape(1, self.block_size)) for a in self.attn_layers) * elem

    def determine_num_blocks(self) -> int:
        """Blocks of this rank's memory; with several ranks, the smallest count over all of
        them, since one block id means the same slot on every rank."""
        num_blocks = self._local_num_blocks()
        if self.tp.size > 1:
            t = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
            num_blocks = int(t.item())
        return num_blocks

    def _local_num_blocks(self) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if self.device.type == "cuda" and cc.kv_cache_memory_bytes is None:
            budget = self._profile_free_memory()
        else:
            budget = cc.kv_cache_memory_bytes or CPU_DEFAULT_KV_BYTES
        num_blocks = budget // self.block_bytes()
        if self.device.type != "cuda":
            # on the CPU, never allocate more than the scheduler can use
            max_len = self.config.model_config.max_model_len
            num_blocks = min(num_blocks, sc.max_num_seqs * -(-max_len // self.block_size))
        if num_blocks <= 0:
            raise RuntimeError("no memory left for the KV cache: lower max_num_batched_tokens or raise "
                               "gpu_memory_utilization")
        return int(num_blocks)

    @torch.inference_mode()
    def _profile_free_memory(self) -> int:
        """Run the largest batch once without a cache and return the bytes the KV cache may use."""
        sc = self.config.scheduler_config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = sc.max_num_batched_tokens
        seq_len = min(self.config.model_config.max_model_len, num_tokens)
        num_seqs = max(1, num_tokens // seq_len)
        cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=self.device) * seq_len
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_seqs * seq_len,), -1, dtype=torch.int64, device=self.device),
            cu_seqlens_q=cu, seq_lens=cu[1:] - cu[:-1], block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32,
                                                                                  device=self.device),
            max_seqlen_q=seq_len, max_seqlen_k=seq_len,
        )
        input_ids = torch.zeros(num_seqs * seq_len, dtype=torch.int64, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        with set_forward_context(meta, positions, self.attn_layer_map):
            hidden = self.model(input_ids, positions)
        rows = min(sc.max_num_seqs, hidden.shape[0])
        self.model.compute_logits(hidden[:rows]).float().softmax(-1)
        del hidden
        torch.cuda.synchronize()
        util = self.config.cache_config.gpu_memory_utilization
        now = MemorySnapshot.take(self.device)
        b = kv_cache_budget(self._memory_at_start, now, util)
        logger.info("memory profile: weights and buffers %.2f GiB, peak activations %.2f GiB, outside torch "
                    "%.2f GiB; %.2f GiB of %.2f (gpu_memory_utilization %.2f) left for the KV cache",
                    b.weights / GIB, b.activations / GIB, b.non_torch / GIB, b.kv_cache / GIB, now.total / GIB, util)
        if b.kv_cache < self.block_bytes():
            raise RuntimeError(no_room_message(b, util, now.total))
        return b.kv_cache

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (len(self.attn_layers), *self.attn_layers[0].kv_cache_shape(num_blocks, self.block_size))
        self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.bind_kv_cache(self.kv_cache[i])
        gib = self.kv_cache.numel() * self.kv_cache.element_size() / (1 << 30)
        logger.info("KV cache: %d blocks, %d tokens, %.2f GiB (%s)", num_blocks, num_blocks * self.block_size,
                    gib, self.kv_cache_dtype)

    # one step
    def _tensor(self, data, dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the batch. Plain Python lists for the per-token fields (a decode row is a
        handful of integer ops), then one packed host-to-device copy for everything. A decode
        row whose token is still a ``PLACEHOLDER`` (async scheduling) gets it from the last
        step's sampled tokens, on the device."""
        bs = self.block_size
        ids, pos, slots, cu, seq_lens = [], [], [], [0], []
        fill_at, fill_from = [], []  # placeholder token index -> row of the last step's samples
        for seq, start, n in zip(batch.requests, batch.starts, batch.num_new_tokens):
            table = seq.block_table
            if n == 1:  # decode
                token = seq.token_ids[start]
                if token == PLACEHOLDER:
                    fill_at.append(len(ids))
                    fill_from.append(self._last_sampled_rows[seq.request_id])
                ids.append(token)
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:  # prompt tokens: known on the host (a placeholder only ever follows a sample)
                p = range(start, start + n)
                ids.extend(seq.token_ids[start : start + n])
                pos.extend(p)
                slots.extend(table[i // bs] * bs + i % bs for i in p)
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
        num_seqs, num_tokens, num_fills = len(batch.requests), len(ids), len(fill_at)
        width = max(len(s.block_table) for s in batch.requests)
        max_query, num_decodes, num_rows, token_rows = max(batch.num_new_tokens), batch.num_decodes, num_seqs, []
        if self.spec is not None and 1 < max_query <= self.spec.k + 1:
            # A verify step (1 + K tokens a row): each token becomes a decode row over its
            # causal prefix, the same attention, so the step takes the decode kernels and
            # the decode CUDA graphs (vLLM's uniform-decode graphs for speculative steps).
            token_rows = np.repeat(np.arange(num_seqs), batch.num_new_tokens)
            num_rows = num_decodes = num_tokens
            max_query, cu, seq_lens = 1, list(range(num_tokens + 1)), [p + 1 for p in pos]
        # one int64 buffer: ids | positions | slots | cu_seqlens | seq_lens | fills | token rows | block tables
        t, nt = num_tokens, len(token_rows)
        buf = np.zeros(3 * t + 2 * num_rows + 1 + 2 * num_fills + nt + num_seqs * width, dtype=np.int64)
        buf[: 3 * t] = ids + pos + slots
        o = 3 * t
        buf[o : o + num_rows + 1] = cu
        buf[o + num_rows + 1 : o + 2 * num_rows + 1] = seq_lens
        f = o + 2 * num_rows + 1
        buf[f : f + 2 * num_fills] = fill_at + fill_from
        r = f + 2 * num_fills
        buf[r : r + nt] = token_rows
        tables = buf[r + nt :].reshape(num_seqs, width)
        for i, seq in enumerate(batch.requests):
            tables[i, : len(seq.block_table)] = seq.block_table
        dev = self._tensor(buf, torch.int64)
        input_ids = dev[:t]
        if num_fills:
            input_ids[dev[f : f + num_fills]] = self._last_sampled[dev[f + num_fills : f + 2 * num_fills]]
        block_tables = dev[r + nt :].view(num_seqs, width).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=dev[2 * t : 3 * t],
            cu_seqlens_q=dev[o : o + num_rows + 1].to(torch.int32),
            seq_lens=dev[o + num_rows + 1 : o + 2 * num_rows + 1].to(torch.int32),
            # decode rows of a verify step read their sequence's table, repeated on the device
            block_tables=block_tables[dev[r : r + nt]] if nt else block_tables,
            max_seqlen_q=max_query,
            max_seqlen_k=max(seq_lens),
            num_decode_tokens=num_decodes,
            cu_seqlens_q_cpu=cu,
            seq_lens_cpu=seq_lens,
        )
        return input_ids, dev[t : 2 * t], meta

    def sampling_tensors(self, seqs: list[ScheduledRequest], gens: list[torch.Generator | None]) -> SamplingTensors:
        params = [s.sampling_params for s in seqs]
        temps = [p.temperature for p in params]
        top_k = [float(p.top_k) for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        packed = self._tensor(temps + top_k + top_p + min_p, torch.float32).view(4, len(seqs))
        return SamplingTensors(
            temperatures=packed[0],
            top_k=packed[1].to(torch.int32) if any(top_k) else None,
            top_p=packed[2] if any(x < 1 for x in top_p) else None,
            min_p=packed[3] if any(min_p) else None,
            generators=gens,
            all_greedy=all(t == 0 for t in temps),
        )

    def _generator(self, seq: ScheduledRequest) -> torch.Generator | None:
        p = seq.sampling_params
        if p.seed is None or p.temperature == 0:
            return None
        if seq.request_id not in self.generators:
            self.generators[seq.request_id] = torch.Generator(device=self.device).manual_seed(p.seed)
        return self.generators[seq.request_id]

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def dummy_forward(self) -> None:
        """One padding token through the model (its KV goes nowhere: slot -1), so that this
        data-parallel-attention replica joins the MoE layers of a step only others run."""
        self.run_model(*warmup_inputs([1], [1], self.block_size, self.device))

    def run_model(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        with set_forward_context(meta, positions, self.attn_layer_map):
            if self.graph_runner is not None and self.graph_runner.can_run(meta, input_ids.shape[0]):
                return self.graph_runner.run(input_ids, positions, meta)
            if self.piecewise is not None and self.piecewise.can_run(input_ids.shape[0]):
                return self.piecewise.run(input_ids, positions)
            return self.forward(input_ids, positions)

    # compilation
    def _maybe_compile(self):
        cc = self.config.compilation_config
        if cc.level < 3 or self.device.type != "cuda":
            return self.model.forward
        logger.info("level 3: torch.compile of the model (attention stays one opaque op); "
                    "the first batches compile, later runs hit the inductor cache")
        return torch.compile(self.model.forward, dynamic=True)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run one batch of each kind the scheduler produces (``atom.worker.warmup``) so that
        torch.compile and the Triton kernel variants compile at start-up rather than inside
        the first requests."""
        if self.device.type != "cuda":
            return
        sc = self.config.scheduler_config
        start = time.perf_counter()
        batches = warmup_batches(sc.max_num_batched_tokens, self.config.model_config.max_model_len)
        for q_lens, seq_lens in batches:
            hidden = self.run_model(*warmup_inputs(q_lens, seq_lens, self.block_size, self.device))
        warm_up_sampler(self.model.compute_logits, hidden, sc.max_num_seqs)
        torch.cuda.synchronize()
        logger.info("warm-up (compilation of %d batch kinds and the sampler) took %.1f s", len(batches),
                    time.perf_counter() - start)

    def capture_cudagraphs(self) -> None:
        """Capture decode graphs unless eager is asked for or the ops cannot be captured; the
        last step of start-up, so from here on a Triton kernel compiled is a warm-up gap."""
        if self.device.type == "cuda":
            log_late_compiles("during the CUDA-graph capture")
        self._capture_cudagraphs()
        if self.device.type == "cuda":
            log_late_compiles()

    def _capture_cudagraphs(self) -> None:
        from atom.ops import use_triton
        from atom.worker.cuda_graph import CUDAGraphRunner

        cc, mc = self.config.compilation_config, self.config.model_config
        if cc.enforce_eager or cc.cudagraph_mode == "NONE" or self.device.type != "cuda":
            return
        if not use_triton(self.device):
            logger.warning("CUDA graphs need the Triton ops (ATOM_FORCE_REFERENCE_OPS is set): running eagerly")
            return
        # a verify step runs 1 + K decode rows per sequence
        max_rows = self.config.scheduler_config.max_num_seqs * (1 + (self.spec.k if self.spec is not None else 0))
        sizes = [s for s in cc.cudagraph_capture_sizes if s <= max_rows]
        if not sizes:
            return

        def capture(forward, layer_map, hidden_inputs=0) -> CUDAGraphRunner:
            runner = CUDAGraphRunner(forward, sizes, mc.max_model_len, self.block_size, mc.hf_config.hidden_size,
                                     mc.dtype, self.device, hidden_inputs)  # fmt: skip
            with set_forward_context(None, None, layer_map):
                runner.capture()
            return runner

        self.graph_runner = capture(self.forward, self.attn_layer_map)
        proposer = self.spec.proposer if self.spec is not None else None
        if isinstance(proposer, MtpProposer):  # the draft's rows: kept tokens of a verify step, then one a row
            proposer.loop.graphs = capture(proposer.draft.forward, proposer.layer_map, hidden_inputs=1)
        elif isinstance(proposer, SharedWeightsProposer):
            # the target drafts through its own graphs: their output buffer is the verify step's
            # hidden states, which every read of has been queued before the draft runs
            proposer.loop.graphs = self.graph_runner
        if cc.cudagraph_mode == "FULL_AND_PIECEWISE" and cc.level < 3:
            logger.info("level %d runs the model eagerly: mixed batches get no piecewise CUDA graphs (they are "
                        "pieces of the model's Dynamo graph); decode batches keep theirs", cc.level)
        elif cc.cudagraph_mode == "FULL_AND_PIECEWISE":
            self._capture_piecewise()

    def _capture_piecewise(self) -> None:
        """Piecewise graphs for mixed batches up to the scheduler's token budget; the capture
        runs each size as prompts of at most ``max_model_len`` tokens that write no KV."""
        cc, max_len = self.config.compilation_config, self.config.model_config.max_model_len
        sizes = [s for s in cc.piecewise_capture_sizes if s <= self.config.scheduler_config.max_num_batched_tokens]
        if not sizes:
            return

        def meta_for(size: int) -> AttentionMetadata:
            q_lens = [min(max_len, size - start) for start in range(0, size, max_len)]
            return warmup_inputs(q_lens, q_lens, self.block_size, self.device)[2]

        piecewise = PiecewiseGraphs(self.model.forward, sizes, self.device)
        piecewise.capture(self.attn_layer_map, meta_for)
        self.piecewise = piecewise

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput) -> PendingOutput:
        """Queue the step's device work (model, logits, sampling, the copy of the sampled ids
        to the host) without waiting for it; ``result()`` of the returned handle waits."""
        input_ids, positions, meta = self.prepare(batch)
        hidden = self.run_model(input_ids, positions, meta)
        pending = PendingOutput()
        cu = np.cumsum([0] + batch.num_new_tokens)
        for i, seq in enumerate(batch.requests):
            # now, while ``hidden`` (a CUDA graph's output buffer) is this step's
            if seq.sampling_params.prompt_logprobs is not None and batch.starts[i] < seq.num_prompt_tokens:
                with _row_errors(pending.errors, i, seq):
                    pending.prompt_logprobs[i] = prompt_logprobs(
                        self.model.compute_logits, hidden, seq, batch.starts[i], int(cu[i]), batch.num_new_tokens[i])
        rows = [i for i, samples in enumerate(batch.samples) if samples]
        if not rows:
            if self.spec is not None:  # an MTP draft still reads the chunks into its KV cache
                self.spec.step(batch, [], cu.tolist(), hidden, None, None)
            return pending
        seqs = [batch.requests[i] for i in rows]
        gens = [None] * len(seqs)
        for j, seq in enumerate(seqs):
            with _row_errors(pending.errors, rows[j], seq):  # e.g. a seed out of range
                gens[j] = self._generator(seq)
        logits = self.model.compute_logits(hidden[self._tensor(cu[1:][rows] - 1, torch.int64)])
        raw = logits  # logprobs come from the raw logits (vLLM's default)
        logits = process_logits(logits, seqs, batch.grammar_bitmask)
        st = self.sampling_tensors(seqs, gens)
        tokens = sample(logits, st)
        if self.spec is not None:  # verify this step's drafts, propose the next ones
            tokens, pending.spec = self.spec.step(batch, rows, cu.tolist(), hidden, tokens, st)
        self._last_sampled = tokens
        self._last_sampled_rows = {seq.request_id: j for j, seq in enumerate(seqs)}
        pending.rows = rows
        pending.want_logprobs = [s.sampling_params.logprobs for s in seqs]
        if any(n is not None for n in pending.want_logprobs):
            pending.logprobs = top_logprobs(raw, tokens, max(n or 0 for n in pending.want_logprobs))
        if tokens.is_cuda:
            pending.tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            pending.tokens.copy_(tokens, non_blocking=True)
            pending.ready = torch.cuda.Event()
            pending.ready.record()
        else:
            pending.tokens = tokens
        return pending


@dataclass
class PendingOutput:
    """A launched step's results, on their way to the host."""

    rows: list[int] = field(default_factory=list)  # batch indices that sampled
    tokens: torch.Tensor | None = None  # their tokens (pinned host memory on CUDA)
    ready: torch.cuda.Event | None = None  # recorded after the device-to-host copy
    want_logprobs: list[int | None] = field(default_factory=list)
    logprobs: tuple | None = None  # top_logprobs(...) of the sampled rows, on the device
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    # speculative decoding: (accepted drafts, next drafts) by row
    spec: tuple[dict, dict] = field(default_factory=lambda: ({}, {}))

    def result(self) -> RunnerOutput:
        if self.ready is not None:
            self.ready.synchronize()
        sampled, logprobs, errors = {}, {}, self.errors
        if self.tokens is not None:
            for j, (i, tok) in enumerate(zip(self.rows, self.tokens.tolist())):
                sampled[i] = tok
                if self.logprobs is not None and self.want_logprobs[j] is not None and i not in errors:
                    logprobs[i] = token_logprobs(self.logprobs, j, tok, self.want_logprobs[j])
        return RunnerOutput(sampled, logprobs, self.prompt_logprobs, errors, *self.spec)


@contextlib.contextmanager
def _row_errors(errors: dict[int, str], row: int, seq: ScheduledRequest):
    """Record an exception of one request's own work as that row's error. Device failures
    (CUDA errors, out of memory) are not one request's fault: they propagate."""
    try:
        yield
    except Exception as e:
        if isinstance(e, torch.OutOfMemoryError) or "CUDA" in str(e):
            raise
        logger.exception("request %s failed in the model runner", seq.request_id)
        errors[row] = f"{type(e).__name__}: {e}"
