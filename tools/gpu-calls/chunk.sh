#!/usr/bin/env bash
# Calls 1-3 of vLLM's set: `bash tools/gpu-calls/chunk.sh zN` with `carry: [".whl_vllm/zN"]` (N = 1, 2, 3),
# back to back. Call 1 starts over; calls 2 and 3 check that the machine kept the parts before them.
set -euo pipefail
n=${1#z}
if [ "$n" = 1 ]; then
    rm -rf /tmp/vllmwheels /tmp/site
    mkdir -p /tmp/vllmwheels
else
    have=$(ls /tmp/vllmwheels 2>/dev/null | wc -l || true)
    [ "$have" = $((n - 1)) ] || { echo "RESTART from z1: machine not warm ($have files)"; exit 3; }
fi
cp ".whl_vllm/z$n"/* /tmp/vllmwheels/ && ls /tmp/vllmwheels | wc -l
