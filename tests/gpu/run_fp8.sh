#!/usr/bin/env bash
# FP8 on one GPU (issue 17): kernels vs references at real shapes, kernel timings, and, when
# model paths are given, teacher-forced agreement end to end. Details land in $OUT (or
# ./gpu-results); a short table is printed last.
#   tests/gpu/run_fp8.sh [/path/to/Qwen3-8B [/path/to/Qwen3-8B-FP8]]
set -uo pipefail
out=${OUT:-gpu-results}; mkdir -p "$out"
export OUT=$out PYTHONUNBUFFERED=1
python -m pytest tests/gpu/test_fp8_gpu.py -q -x 2>&1 | tail -15 | tee "$out/fp8_kernels.txt"
python tests/gpu/fp8_bench.py > "$out/fp8_bench.txt" 2>&1; tail -40 "$out/fp8_bench.txt"
if [ $# -ge 1 ]; then
  python tests/gpu/fp8_e2e.py --model "$1" ${2:+--fp8-model "$2"} > "$out/fp8_e2e.txt" 2>&1; tail -5 "$out/fp8_e2e.txt"
fi
