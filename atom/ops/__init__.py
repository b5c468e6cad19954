"""The kernel boundary: one function per (fused) op.

Each function takes plain tensors and dispatches by device: the Triton kernel on a
CUDA/ROCm tensor when Triton is importable, the PyTorch reference of
``atom.ops.reference`` otherwise. ``ATOM_FORCE_REFERENCE_OPS=1`` forces the reference
everywhere (for debugging a kernel).

Ops are declared once, in the table at the end, with ``register_op``: the reference (whose
signature is the op's), the Triton kernel as ``"module:function"`` (imported lazily), the
output shapes for torch.compile's fake tensors and the arguments it writes. A new kernel is
its file under ``atom/ops/triton/`` plus one ``register_op`` line here.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atom.ops import mla, penalties, reference, reference_fp8, rejection, sampling

__all__ = [
    "apply_penalties",
    "fused_moe",
    "fp8_gated_linear",
    "fp8_linear",
    "fused_add_rms_norm_fp8",
    "fused_moe_fp8",
    "gated_linear",
    "grouped_topk",
    "linear",
    "mla_decode",
    "mla_prefill_attention",
    "mla_rope_store",
    "moe_topk",
    "paged_attention",
    "paged_attention_into",
    "unwrapped",
    "per_token_group_quant_fp8",
    "qk_norm_rope_store",
    "rejection_sample",
    "rms_norm",
    "rotary_embedding",
    "sample_tokens",
    "silu_and_mul",
    "store_kv_cache",
    "top_k_top_p_min_p",
    "w8a8_matmul",
    "init_device_ops",
    "register_op",
    "use_triton",
]


@dataclass(frozen=True, slots=True)
class OpSpec:
    name: str
    reference: Callable  # the PyTorch implementation; its signature is the custom op's schema
    triton: str  # "module:function" of the Triton kernel with the same semantics
    fake: Callable  # output shapes for torch.compile
    mutates: tuple[str, ...] = ()  # arguments written in place


# name -> spec, filled at import by the table below (constant afterwards)
_OPS: dict[str, OpSpec] = {}


def register_op(name: str, *, triton: str, fake: Callable, mutates: tuple[str, ...] = ()):
    """Decorator for an op's reference implementation: records the op and returns the
    public function that dispatches to the Triton kernel or to the reference."""

    def wrap(ref: Callable) -> Callable:
        if name in _OPS:
            raise ValueError(f"op {name!r} is registered twice")
        _OPS[name] = OpSpec(name, ref, triton, fake, tuple(mutates))
        return _dispatch(name, ref)

    return wrap


@functools.cache
def _triton_module():
    if os.environ.get("ATOM_FORCE_REFERENCE_OPS", "0") == "1":
        return None
    try:
        return importlib.import_module("atom.ops.triton")
    except ImportError:
        return None


def use_triton(device) -> bool:
    """Whether ops on ``device`` run the Triton kernels."""
    return getattr(device, "type", device) == "cuda" and _triton_module() is not None


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


@functools.cache
def _kernel(spec: OpSpec) -> Callable:
    module, _, fn = spec.triton.partition(":")
    return getattr(importlib.import_module(module), fn)


def _make_custom_op(spec: OpSpec):
    """``torch.ops.atom.triton_<name>``: an opaque custom op around the Triton kernel, so
    compiled graphs call the kernel rather than tracing its Python launcher."""
    schema = torch.library.infer_schema(spec.reference, mutates_args=spec.mutates)
    op = torch.library.custom_op(
        f"atom::triton_{spec.name}", _kernel(spec), mutates_args=spec.mutates, device_types="cuda", schema=schema
    )
    op.register_fake(spec.fake)
    return getattr(torch.ops.atom, f"triton_{spec.name}").default


def _make_reference_op(spec: OpSpec):
    """``torch.ops.atom.ref_<name>``: the reference as an opaque custom op, for graphs compiled
    off CUDA (Dynamo cannot trace a reference's data-dependent loops, e.g. fused_moe's)."""
    schema = torch.library.infer_schema(spec.reference, mutates_args=spec.mutates)
    op = torch.library.custom_op(f"atom::ref_{spec.name}", spec.reference, mutates_args=spec.mutates, schema=schema)
    op.register_fake(spec.fake)
    return getattr(torch.ops.atom, f"ref_{spec.name}").default


# name -> custom op, filled once by init_device_ops; plain dicts, so torch.compile traces
# the lookup instead of breaking the graph on a cached function
_CUDA_OPS: dict[str, Callable] = {}
_REF_OPS: dict[str, Callable] = {}


def init_device_ops(device) -> None:
    """Register the custom ops for ``device`` before anything compiles a model there: the
    Triton kernels on CUDA, the references elsewhere. The model runner calls this; the first
    CUDA op call does it otherwise. Triton is imported lazily so that tests can switch it to
    its interpreter first."""
    if getattr(device, "type", device) != "cuda":
        if not _REF_OPS:
            _REF_OPS.update({name: _make_reference_op(spec) for name, spec in _OPS.items()})
        return
    if _CUDA_OPS or _triton_module() is None:
        return
    for name, spec in _OPS.items():
        _CUDA_OPS[name] = _make_custom_op(spec)


def _dispatch(name: str, ref: Callable) -> Callable:
    @functools.wraps(ref)
    def op(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if first.is_cuda:
            if not _CUDA_OPS:
                init_device_ops(first.device)
            if _CUDA_OPS:
                return _CUDA_OPS[name](*args, **kwargs)
        elif _REF_OPS and torch.compiler.is_compiling():
            return _REF_OPS[name](*args, **kwargs)
        return ref(*args, **kwargs)

    return op


# the ops: one line each
_T = "atom.ops.triton"


@register_op("rms_norm", triton=f"{_T}.norm:rms_norm", fake=lambda x, weight, eps: _empty_like(x))
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return reference.rms_norm(x, weight, eps)


@register_op(
    "fused_add_rms_norm",
    triton=f"{_T}.norm:rms_norm",
    fake=lambda x, weight, eps, residual: (_empty_like(x), _empty_like(x)),
)
def _fused_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.rms_norm(x, weight, eps, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim; with ``residual``, first ``x = x + residual`` and return
    ``(normed, x)`` (see ``reference.rms_norm``). Two ops underneath: a custom op's schema
    returns either one tensor or two."""
    if residual is None:
        return _rms_norm(x, weight, eps)
    return _fused_add_rms_norm(x, weight, eps, residual)


@register_op(
    "linear",
    triton=f"{_T}.gemv:linear",
    fake=lambda x, weight, bias=None: x.new_empty((*x.shape[:-1], weight.shape[0])),
)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on CUDA the skinny Triton GEMM for a few rows (decode), cuBLAS otherwise."""
    return F.linear(x, weight, bias)


@register_op(
    "gated_linear",
    triton=f"{_T}.gemv:gated_linear",
    fake=lambda x, weight, bias=None: x.new_empty((*x.shape[:-1], weight.shape[0] // 2)),
)
def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight, bias))`` for a gate-then-up weight; on CUDA, at decode
    sizes, one skinny-GEMM launch with the activation in its epilogue."""
    return reference.silu_and_mul(F.linear(x, weight, bias))


silu_and_mul = register_op(
    "silu_and_mul",
    triton=f"{_T}.activation:silu_and_mul",
    fake=lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)),
)(reference.silu_and_mul)
rotary_embedding = register_op(
    "rotary_embedding",
    triton=f"{_T}.rope_cache:rotary_embedding",
    fake=lambda positions, q, k, cos_sin_cache: (_empty_like(q), _empty_like(k)),
)(reference.rotary_embedding)
store_kv_cache = register_op(
    "store_kv_cache", triton=f"{_T}.rope_cache:store_kv_cache", fake=lambda *args: None, mutates=("k_cache", "v_cache")
)(reference.store_kv_cache)
qk_norm_rope_store = register_op(
    "qk_norm_rope_store",
    triton=f"{_T}.rope_cache:qk_norm_rope_store",
    fake=lambda q, k, *args: (_empty_like(q), _empty_like(k)),
    mutates=("k_cache", "v_cache"),
)(reference.qk_norm_rope_store)
paged_attention = register_op(
    "paged_attention", triton=f"{_T}.attention:paged_attention", fake=lambda q, *args: _empty_like(q)
)(reference.paged_attention)


def unwrapped(name: str, device) -> Callable:
    """Op ``name`` on ``device`` without its custom-op wrapper: the Triton kernel on CUDA, the
    reference elsewhere. For callers already inside an opaque op (the attention layers), where
    the wrapper's dispatch is only host time: 37 us a call on an H200 host (docs/performance.md)."""
    spec = _OPS[name]
    return _kernel(spec) if use_triton(device) else spec.reference


def paged_attention_into(out: torch.Tensor, *args, **kwargs) -> None:
    """``out[:] = paged_attention(*args, **kwargs)``, for callers already inside an opaque op:
    on CUDA the kernel writes ``out`` directly (no copy, no wrapper's dispatch)."""
    if use_triton(out.device):
        unwrapped("paged_attention", out.device)(*args, **kwargs, out=out)
    else:
        out.copy_(reference.paged_attention(*args, **kwargs))


moe_topk = register_op(
    "moe_topk",
    triton=f"{_T}.moe:moe_topk",
    fake=lambda logits, top_k, renormalize: (
        logits.new_empty((logits.shape[0], top_k), dtype=torch.float32),
        logits.new_empty((logits.shape[0], top_k), dtype=torch.int64),
    ),
)(reference.moe_topk)


def _grouped_topk_fake(logits, top_k, scoring, num_groups, topk_groups, correction_bias, renormalize, scaling,
                       num_fused_shared=0):  # fmt: skip
    shape = (logits.shape[0], top_k + num_fused_shared)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


grouped_topk = register_op("grouped_topk", triton=f"{_T}.moe:grouped_topk", fake=_grouped_topk_fake)(
    reference.grouped_topk
)
fused_moe = register_op("fused_moe", triton=f"{_T}.moe:fused_moe", fake=lambda x, *args: _empty_like(x))(
    reference.fused_moe
)
top_k_top_p_min_p = register_op(
    "top_k_top_p_min_p", triton=f"{_T}.sampling:top_k_top_p_min_p", fake=lambda logits, *args: _empty_like(logits)
)(reference.top_k_top_p_min_p)
sample_tokens = register_op(
    "sample_tokens",
    triton=f"{_T}.sampling_fused:sample_tokens",
    fake=lambda logits, *args: logits.new_empty(logits.shape[:1], dtype=torch.int64),
)(sampling.sample_tokens)
apply_penalties = register_op(
    "apply_penalties",
    triton=f"{_T}.penalties:apply_penalties",
    fake=lambda logits, *args: logits.new_empty(logits.shape, dtype=torch.float32),
)(penalties.apply_penalties)
per_token_group_quant_fp8 = register_op(
    "per_token_group_quant_fp8",
    triton=f"{_T}.fp8_gemm:per_token_group_quant_fp8",
    fake=lambda x, group_k: (
        x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
        # group-major scales (strides (1, M)): the layout both implementations return
        x.new_empty((-(-x.shape[1] // (group_k or x.shape[1])), x.shape[0]), dtype=torch.float32).t(),
    ),
)(reference_fp8.per_token_group_quant_fp8)
w8a8_matmul = register_op(
    "w8a8_matmul",
    triton=f"{_T}.fp8_gemm:w8a8_matmul",
    fake=lambda a, a_scale, w, w_scale, group_k, out_dtype, bias=None, w_block_scale=None: a.new_empty(
        (a.shape[0], w.shape[0]), dtype=out_dtype
    ),
)(reference_fp8.w8a8_matmul)
fused_add_rms_norm_fp8 = register_op(
    "fused_add_rms_norm_fp8",
    triton=f"{_T}.norm:rms_norm_fp8",
    fake=lambda x, weight, eps, residual, group_k: (
        _empty_like(x),
        _empty_like(x),
        x.new_empty((x.numel() // x.shape[-1], x.shape[-1]), dtype=torch.float8_e4m3fn),
        x.new_empty((x.shape[-1] // group_k, x.numel() // x.shape[-1]), dtype=torch.float32).t(),
    ),
)(reference_fp8.fused_add_rms_norm_fp8)
fp8_linear = register_op(
    "fp8_linear",
    triton=f"{_T}.fp8_gemm:fp8_linear",
    fake=lambda x, w, *args: x.new_empty((x.shape[0], w.shape[0])),
)(reference_fp8.fp8_linear)


@register_op(
    "fp8_gated_linear",
    triton=f"{_T}.fp8_gemm:fp8_gated_linear",
    fake=lambda x, w, *args: x.new_empty((x.shape[0], w.shape[0] // 2)),
)
def fp8_gated_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_k: int, bias: torch.Tensor | None = None,
    w_block_scale: torch.Tensor | None = None, x_codes: torch.Tensor | None = None,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu_and_mul(fp8_linear(...))`` for a gate-then-up e4m3 weight; on CUDA, at decode sizes, the
    activation in the skinny kernel's launch."""
    return reference.silu_and_mul(
        reference_fp8.fp8_linear(x, w, w_scale, group_k, bias, w_block_scale, x_codes, x_scales)
    )


fused_moe_fp8 = register_op(
    "fused_moe_fp8", triton=f"{_T}.moe_fp8:fused_moe_fp8", fake=lambda x, *args: _empty_like(x)
)(reference_fp8.fused_moe_fp8)
mla_rope_store = register_op(
    "mla_rope_store",
    triton=f"{_T}.mla:mla_rope_store",
    fake=lambda q, kv_c, k_pe, *args: (_empty_like(q), _empty_like(k_pe)),
    mutates=("kv_cache",),
)(mla.mla_rope_store)


def mla_rope_store_into(
    q_pe_out: torch.Tensor, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None, interleaved: bool,
    k_scale: torch.Tensor | None = None, kv_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``mla_rope_store`` writing only the query's rotated rope columns, into ``q_pe_out`` [T, H,
    rope] (a view: the tail of the absorbed decode query); returns the rotated ``k_pe``.
    ``kv_norm``: (weight, eps) of an RMSNorm the latent ``kv_c`` takes before the cache write
    (in the same kernel on CUDA). For callers already inside an opaque op: on CUDA the kernel
    writes the view directly."""
    args = (positions, cos_sin_cache, kv_cache, slot_mapping, interleaved, k_scale)
    if use_triton(q.device):
        return unwrapped("mla_rope_store", q.device)(q, kv_c, k_pe, *args, q_pe_out=q_pe_out, kv_norm=kv_norm)[1]
    if kv_norm is not None:
        kv_c = reference.rms_norm(kv_c, *kv_norm)
    q_rot, k_pe = mla.mla_rope_store(q, kv_c, k_pe, *args)
    q_pe_out.copy_(q_rot[..., -q_pe_out.shape[-1] :])
    return k_pe


mla_decode = register_op(
    "mla_decode",
    triton=f"{_T}.mla:mla_decode",
    fake=lambda q, kv_cache, seq_lens, block_tables, scale, kv_lora_rank, k_scale=None: q.new_empty(
        (q.shape[0], q.shape[1], kv_lora_rank)
    ),
)(mla.mla_decode)
mla_prefill_attention = register_op(
    "mla_prefill_attention",
    triton=f"{_T}.mla_prefill:mla_prefill_attention",
    fake=lambda q, kv, k_pe, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, v_head_dim: q.new_empty(
        (q.shape[0], q.shape[1], v_head_dim)
    ),
)(mla.mla_prefill_attention)
rejection_sample = register_op(
    "rejection_sample",
    triton=f"{_T}.rejection:rejection_sample",
    fake=lambda draft_ids, *args: draft_ids.new_empty((draft_ids.shape[0], draft_ids.shape[1] + 1)),
)(rejection.rejection_sample)
