# The environment of every run on the machine after install.sh (later calls on the warm machine: `. tools/gpu-calls/env.sh`)
export PATH=/opt/torch/.venv/bin:$PATH PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
    HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
