"""Compiles Triton kernels for Hopper (sm_90) on a machine without a GPU, down to the cubin: what the
interpreter cannot see (a runtime branch that changes a variable's shape, an MMA's operand layouts)
fails here as it would on the GPU. Run by test_sm90_compile.py in its own process: the kernel tests'
conftest puts Triton in interpreter mode for the whole session.

    python tests/kernels/sm90_compile.py   # prints one line per variant, exits 1 on any failure
"""

from __future__ import annotations

import itertools
import sys
import traceback

from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> None:
    """``fn`` (a ``triton.jit`` function) compiled for ``TARGET`` with its argument types (in order) and
    constexpr values; raises what the compiler raises."""
    sig = {name: signature.get(name, "constexpr") for name in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v for c, v in constexprs.items()})
    backend = make_backend(TARGET)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(TARGET, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)  # fmt: skip
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    metadata: dict = {}
    for ext, stage in stages.items():
        if ext != "source":
            module = stage(module, metadata)


def skinny_variants():
    """The skinny GEMM's constexpr branches: bf16 and FP8 (activations quantised in the kernel), key
    splits added by a second kernel or not, gated or not."""
    from atom.ops.triton.gemv import _skinny_gemm_kernel

    ints = ["M", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_om", "stride_os", "stride_xsm",
            "stride_xsk", "stride_wsn", "stride_wsk"]  # fmt: skip
    for fp8, mode, partial, gated in itertools.product([False, True], [0, 3], [False, True], [False, True]):
        sig = dict.fromkeys(["x_ptr", "b_ptr", "out_ptr"], "*bf16")
        sig.update(w_ptr="*fp8e4nv" if fp8 else "*bf16", xs_ptr="*fp32", ws_ptr="*fp32",
                   **dict.fromkeys(ints, "i32"))  # fmt: skip
        if partial:
            sig["out_ptr"] = "*fp32"  # the partial sums
        const = dict(HAS_BIAS=True, PARTIAL=partial, EVEN_K=True, MODE=mode, SCALES=2 if fp8 else 0,
                     BLOCK_M=16 if mode else 1, BLOCK_N=64 if mode else 8, BLOCK_K=128, QUANT_X=fp8,
                     GATED=gated)  # fmt: skip
        yield "_skinny_gemm_kernel", _skinny_gemm_kernel, sig, const


def decode_gemm_helpers():
    """The skinny kernel's split-K reduction (plain and gated) and the FP8 CUDA-core GEMV (float16 runs
    or float32 products; quantising the row or given its codes) at Qwen3-8B's decode launches."""
    from atom.ops.triton.fp8_gemv import _fp8_gemv_kernel
    from atom.ops.triton.gemv import _split_k_reduce_kernel
    from atom.ops.triton.moe_gemv import _moe_gemv_down_kernel, _moe_gemv_gated_kernel

    for gated in (False, True):
        sig = dict(part_ptr="*fp32", b_ptr="*bf16", out_ptr="*bf16", N="i32", stride_pm="i32", stride_ps="i32",
                   stride_om="i32")  # fmt: skip
        const = dict(SPLIT_K=4, HAS_BIAS=False, BLOCK=512 if gated else 1024, GATED=gated)
        yield "_split_k_reduce_kernel", _split_k_reduce_kernel, sig, const
    for half, codes in ((True, False), (False, False), (True, True)):
        ints = ["N", "K", "stride_xm", "stride_xsm", "stride_xsk", "stride_wn", "stride_wsn", "stride_wsk", "stride_om"]
        sig = dict(x_ptr="*fp8e4nv" if codes else "*bf16", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32",
                   b_ptr="*bf16", out_ptr="*bf16", **dict.fromkeys(ints, "i32"))  # fmt: skip
        const = dict(HAS_BIAS=False, EVEN_K=True, BLOCK_N=16, BLOCK_K=1024, GROUP_K=128, HALF=half, CODES=codes)
        yield "_fp8_gemv_kernel", _fp8_gemv_kernel, sig, const
    # the MoE GEMVs share its row loop (``_gemv_rows``, called without codes): FP8 experts at Qwen3-30B-A3B's
    ints = ["N", "K", "stride_xm", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_wsk", "stride_om"]
    sig = dict(x_ptr="*bf16", ids_ptr="*i32", weights_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16",
               **dict.fromkeys(ints, "i32"))  # fmt: skip
    const = dict(EVEN_K=True, BLOCK_N=16, BLOCK_K=512, GROUP_K=128, HALF=True, SCALED=True)
    yield "_moe_gemv_gated_kernel", _moe_gemv_gated_kernel, sig, dict(const, TOP_K=8)
    yield "_moe_gemv_down_kernel", _moe_gemv_down_kernel, sig, const


def attention_variants():
    """The paged attention kernel at decode tiles (Qwen3-8B's heads): unsplit and with key splits;
    bf16 and an fp8 cache."""
    from atom.ops.triton.attention import _paged_attention_kernel

    ptrs = ["out_ptr", "part_out_ptr", "part_max_ptr", "part_sum_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr",
            "cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_ptr", "k_scale_ptr", "v_scale_ptr"]
    ints = ["num_seqs", "num_splits", "min_split_tiles", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
            "stride_cb", "stride_ch", "stride_ct", "stride_bt"]  # fmt: skip
    for split, fp8 in itertools.product([False, True], [False, True]):
        sig = dict.fromkeys(ptrs, "*bf16")
        sig.update(part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", cu_seqlens_q_ptr="*i32",
                   seq_lens_ptr="*i32", block_tables_ptr="*i32", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                   qk_scale="fp32", **dict.fromkeys(ints, "i32"))  # fmt: skip
        if fp8:
            sig.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
        const = dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=4, BLOCK_N=64, HEAD_DIM=128, HEAD_DIM_PAD=128, PAGE_SIZE=16,
                     SPLIT=split, DOT_PRECISION="tf32", HAS_SCALE=fp8)  # fmt: skip
        yield "_paged_attention_kernel", _paged_attention_kernel, sig, const


def norm_variants():
    """The RMS norm with a residual, alone and writing its output's e4m3 codes and group scales."""
    from atom.ops.triton.norm import _rms_norm_kernel

    ints = ["n_cols", "stride_x", "stride_res", "stride_out", "stride_res_out", "stride_q", "stride_qsm",
            "stride_qsg"]  # fmt: skip
    for group in (0, 128):
        sig = dict.fromkeys(["x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"], "*bf16")
        sig.update(q_ptr="*fp8e4nv", qs_ptr="*fp32", eps="fp32", **dict.fromkeys(ints, "i32"))
        yield "_rms_norm_kernel", _rms_norm_kernel, sig, dict(HAS_RESIDUAL=True, BLOCK=4096, GROUP=group)


def main() -> int:
    failed = 0
    variants = itertools.chain(skinny_variants(), decode_gemm_helpers(), attention_variants(), norm_variants())
    for name, fn, sig, const in variants:
        label = f"{name} " + " ".join(f"{k}={v}" for k, v in const.items())
        try:
            compile_sm90(fn, sig, const)
            print("ok", label)
        except Exception:  # every variant is tried; the failures are listed
            failed += 1
            print("FAILED", label, "\n" + traceback.format_exc(limit=1) + str(sys.exc_info()[1])[-2000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
