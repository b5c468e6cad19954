#!/usr/bin/env bash
# vLLM native against vLLM + atom's plugin on the throughput workload, one model after another,
# in the same machine session (run through the device tool from the repo root, after vLLM 0.26.0
# is installed in /tmp/site: ../shared/tools/vllm-gpu/README.md). Writes atom's entry points as a
# dist-info directory (docs/plugin.md), then per model: native, plugin, the tok/s, and from the
# plugin's log the platform line, atom's kernel warm-up and any kernel vLLM saw compiled during
# inference (there should be none). Logs and JSON in $OUT.
#     bash tests/gpu/plugin_compare.sh qwen3-0.6b qwen3-8b
set -uo pipefail
test -d /tmp/site/vllm || { echo "vLLM is not installed in /tmp/site"; exit 3; }
out=${OUT:-gpu-results}; mkdir -p "$out"
d=/tmp/atom_ep/atom_plugin_ep-0.1.0.dist-info; mkdir -p $d
printf 'Metadata-Version: 2.1\nName: atom-plugin-ep\nVersion: 0.1.0\n' > $d/METADATA
printf '[vllm.platform_plugins]\natom = atom.plugin.vllm.register:register_platform\n\n[vllm.general_plugins]\natom = atom.plugin.vllm.register:register_model\n' > $d/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD:/tmp/atom_ep VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
py=/opt/torch/.venv/bin/python3; [ -x $py ] || py=python
for model in "${@:-qwen3-0.6b}"; do
  for off in 1 0; do
    log=$out/tput_${model}_plugin_off$off.log; start=$(date +%s)
    ATOM_DISABLE_VLLM_PLUGIN=$off timeout ${PAIR_TIMEOUT:-300} $py -m atom.benchmarks.benchmark_throughput --model $model \
      --engine vllm --output-json ${log%.log}.json > $log 2>&1
    echo "== $model, ATOM_DISABLE_VLLM_PLUGIN=$off: rc $?, $(( $(date +%s) - start )) s"; tail -1 $log
    grep -m1 "Platform plugin atom is activated" $log
    grep -m1 "atom kernel warm-up" $log | cut -c1-200
    grep "JIT compilation during inference" $log | cut -c1-200
  done
done
