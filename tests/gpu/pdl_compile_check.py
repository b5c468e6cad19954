"""Compile the decode-path kernels with programmatic dependent launch (``USE_PDL``, see
atom/ops/triton/pdl.py) for sm_90 without a GPU, and check the PTX: every kernel lets its
dependents launch and waits (``griddepcontrol``) before its first load of a previous kernel's
output, and the batch-1 GEMV issues its first weight loads before the wait.

    PYTHONPATH=$PWD python tests/gpu/pdl_compile_check.py

Exit status 1 if a kernel fails to compile or its PTX breaks the rule.
"""

from __future__ import annotations

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from atom.ops.triton import activation, attention_merge, gemv, norm, rope_cache


def compile_ptx(kernel, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 2) -> str:
    signature = {name: types.get(name, "i32") for name in kernel.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    # pointers, strides and sizes are multiples of 16 at real shapes: the launcher specialises on that
    aligned = [i for i, n in enumerate(kernel.arg_names) if n not in constexprs and n not in kernel.do_not_specialize
               and (n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K", "k_per_split", "n_cols", "d"))]
    src = ASTSource(kernel, signature, constexprs, {(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip
    return compiled.asm["ptx"]


def bf16(*names: str) -> dict[str, str]:
    return {n: "*bf16" for n in names}


def gemv_types(operands: str = "*bf16") -> dict[str, str]:
    """The skinny GEMM's pointers: ``operands`` for x and the weight, float32 scales."""
    return {"x_ptr": operands, "w_ptr": operands, **bf16("b_ptr", "out_ptr"), "xs_ptr": "*fp32", "ws_ptr": "*fp32"}


CASES = {
    # batch 1, bf16, the config pick_config gives one row of Qwen3-8B (block_n 4, block_k 1024, 2 stages)
    "skinny_gemm (batch 1)": (
        gemv._skinny_gemm_kernel, gemv_types(),
        dict(HAS_BIAS=False, PARTIAL=False, EVEN_K=True, MODE=0, SCALES=0, BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024,
             QUANT_X=False, USE_PDL=True),
        2, True,
    ),
    "skinny_gemm (dot)": (
        gemv._skinny_gemm_kernel, gemv_types(),
        dict(HAS_BIAS=True, PARTIAL=False, EVEN_K=True, MODE=2, SCALES=0, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
             QUANT_X=False, USE_PDL=True),
        4, False,
    ),
    # FP8 block scales: the activation scales come from the previous kernel (the quantiser)
    "skinny_gemm (fp8 blocks)": (
        gemv._skinny_gemm_kernel, gemv_types("*fp8e4nv"),
        dict(HAS_BIAS=False, PARTIAL=False, EVEN_K=True, MODE=2, SCALES=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
             QUANT_X=False, USE_PDL=True),
        4, False,
    ),
    "split_k_reduce": (
        gemv._split_k_reduce_kernel, {"part_ptr": "*fp32", **bf16("b_ptr", "out_ptr")},
        dict(SPLIT_K=4, HAS_BIAS=False, BLOCK=1024, USE_PDL=True), 2, False,
    ),
    "rms_norm (residual)": (
        norm._rms_norm_kernel, {**bf16("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"), "eps": "fp32"},
        dict(HAS_RESIDUAL=True, BLOCK=4096, USE_PDL=True), 2, False,
    ),
    "silu_and_mul": (activation._silu_and_mul_kernel, bf16("x_ptr", "out_ptr"), dict(BLOCK=1024, USE_PDL=True), 2,
                     False),
    "qk_norm_rope_store": (
        rope_cache._qk_norm_rope_store_kernel,
        {**bf16("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_out_ptr", "q_w_ptr", "k_w_ptr", "k_cache_ptr",
                "v_cache_ptr"),
         "pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64", "k_scale_ptr": "*fp32",
         "v_scale_ptr": "*fp32", "eps": "fp32"},
        dict(HAS_NORM=True, HAS_CACHE=True, HAS_SCALE=False, HALF=64, BLOCK_HALF=64, BLOCK_H=8, BLOCK_SIZE=16,
             USE_PDL=True),
        2, False,
    ),
    "merge_splits": (
        attention_merge._merge_splits_kernel,
        {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32"},
        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_S=8, USE_PDL=True), 2, False,
    ),
}  # fmt: skip


def check(ptx: str, prefetch: bool) -> str | None:
    """Why ``ptx`` breaks the rule, or None."""
    launch = ptx.find("griddepcontrol.launch_dependents")
    wait = ptx.find("griddepcontrol.wait")
    loads = [m.start() for m in re.finditer(r"\bld\.global", ptx)]
    if launch < 0 or wait < 0:
        return "no griddepcontrol instructions"
    if launch > wait:
        return "the dependents launch after the wait"
    before = [p for p in loads if p < wait]
    if prefetch and not before:
        return "no weight load before the wait"
    if not prefetch and before:
        return f"{len(before)} global loads before the wait"
    return None


def main() -> int:
    failed = 0
    print("| kernel | compiled | loads before the wait | verdict |\n|---|---|---|---|")
    for name, (kernel, types, constexprs, stages, prefetch) in CASES.items():
        try:
            ptx = compile_ptx(kernel, types, constexprs, num_stages=stages)
        except Exception as e:  # report and go on: one table of every kernel
            print(f"| {name} | no: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | FAIL |")
            failed += 1
            continue
        wait = ptx.find("griddepcontrol.wait")
        before = sum(1 for m in re.finditer(r"\bld\.global", ptx) if m.start() < wait)
        why = check(ptx, prefetch)
        failed += why is not None
        print(f"| {name} | yes | {before} | {why or 'ok'} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
