#!/usr/bin/env bash
# Call 4 of vLLM's set (`carry: [".whl_vllm/z4", ".whl_ct"]`): vLLM 0.26.0 and its small wheels into
# /tmp/site, then the wheels in .whl_ct (compressed-tensors, loguru: vLLM needs them for any
# quantization_config). Source it: `. tools/gpu-calls/install.sh && <your run>`. With NO_VLLM=1 only the
# small wheels (atom's msgspec, pyzmq, fastapi ...), for atom-only runs on a fresh machine (carry z4 alone).
if [ "${NO_VLLM:-0}" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_vllm/z4/*.whl 2>&1 | grep -v WARNING
else
    bash .whl_vllm/z4/install.sh 2>&1 | tail -3
    test -d /tmp/site/vllm || { echo "RESTART: vLLM not installed"; return 3 2>/dev/null || exit 3; }
    if ls .whl_ct/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_ct/*.whl 2>&1 | grep -v WARNING
    fi
fi
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
