#!/usr/bin/env bash
# Everything GPU-side in one go (run through the device tool from the repo root):
# kernel tests at real shapes, the bf16 HF-agreement test, and the benchmarks. Details
# land in $OUT (or ./gpu-results); a short table is printed last.
set -uo pipefail
out=${OUT:-gpu-results}; mkdir -p "$out"
export ATOM_GPU_RESULTS=$out PYTHONUNBUFFERED=1
pip install -q -e . --no-deps 2>/dev/null || true
python -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_penalties_gpu.py tests/gpu/test_mla_gpu.py -q -x 2>&1 | tail -5 | tee "$out/kernels.txt"
python -m pytest tests/gpu/test_hf_agreement.py -q -s -x > "$out/hf_full.txt" 2>&1; grep -E '^\{|passed|failed|Error' "$out/hf_full.txt" | tail -8
python -m atom.benchmarks.benchmark_throughput --model qwen3-0.6b --no-async-scheduling --output-json "$out/tput_0.6b_sync.json" > "$out/tput_0.6b_sync.log" 2>&1; tail -3 "$out/tput_0.6b_sync.log"
python -m atom.benchmarks.benchmark_throughput --model qwen3-0.6b --async-scheduling --output-json "$out/tput_0.6b_async.json" > "$out/tput_0.6b_async.log" 2>&1; tail -3 "$out/tput_0.6b_async.log"
python -m atom.benchmarks.benchmark_latency --model qwen3-8b --output-json "$out/lat_8b.json" > "$out/lat_8b.log" 2>&1; tail -3 "$out/lat_8b.log"
python - "$out" <<'PY'
import glob, json, sys
print("\n== summary ==")
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    print(f.rsplit("/", 1)[1], json.dumps(json.load(open(f))))
PY
