#!/usr/bin/env bash
# vLLM native against vLLM + atom's plugin on the throughput workload, one model after another,
# in the same machine session (run through the device tool from the repo root, after vLLM 0.26.0
# is installed in /tmp/site: ../shared/tools/vllm-gpu/README.md). Writes atom's entry points as a
# dist-info directory (docs/plugin.md), then per model: native, plugin, the tok/s, and from the
# plugin's log the platform line, atom's kernel warm-up and any kernel vLLM saw compiled during
# inference (there should be none). Logs and JSON in $OUT.
#     bash tests/gpu/plugin_compare.sh qwen3-0.6b qwen3-8b
# ORDER (default "1 0 0 1": native, plugin, plugin, native) lists the runs per model by their
# ATOM_DISABLE_VLLM_PLUGIN value: in session 15 the second process of a machine session ran the
# same Python ~1.3x slower (cProfile), which a native-then-plugin pair charges to the plugin. The
# busiest processes are listed before each run (a leftover of the previous run would show there).
set -uo pipefail
test -d /tmp/site/vllm || { echo "vLLM is not installed in /tmp/site"; exit 3; }
out=${OUT:-gpu-results}; mkdir -p "$out"
d=/tmp/atom_ep/atom_plugin_ep-0.1.0.dist-info; mkdir -p $d
printf 'Metadata-Version: 2.1\nName: atom-plugin-ep\nVersion: 0.1.0\n' > $d/METADATA
printf '[vllm.platform_plugins]\natom = atom.plugin.vllm.register:register_platform\n\n[vllm.general_plugins]\natom = atom.plugin.vllm.register:register_model\n' > $d/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD:/tmp/atom_ep VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
py=/opt/torch/.venv/bin/python3; [ -x $py ] || py=python
for model in "${@:-qwen3-0.6b}"; do
  i=0
  for off in ${ORDER:-1 0 0 1}; do
    i=$((i + 1)); log=$out/tput_${model}_${i}_plugin_off$off.log; start=$(date +%s)
    ps -eo pcpu,etime,args --sort=-pcpu | head -4 | cut -c1-150
    ATOM_DISABLE_VLLM_PLUGIN=$off timeout ${PAIR_TIMEOUT:-300} $py -m atom.benchmarks.benchmark_throughput --model $model \
      --engine vllm --output-json ${log%.log}.json > $log 2>&1
    echo "== $model, ATOM_DISABLE_VLLM_PLUGIN=$off: rc $?, $(( $(date +%s) - start )) s"; tail -1 $log
    grep -m1 "Platform plugin atom is activated" $log
    grep -m1 "atom kernel warm-up" $log | cut -c1-200
    grep "JIT compilation during inference" $log | cut -c1-200
  done
done
echo "| model | run | ATOM_DISABLE_VLLM_PLUGIN | output tok/s |"
echo "|---|---|---|---|"
for j in $out/tput_*_plugin_off*.json; do
  $py -c "import json, re, sys; r = json.load(open(sys.argv[1])); m = re.match(r'.*/tput_(.+)_(\d+)_plugin_off(\d)', sys.argv[1])
print(f'| {m[1]} | {m[2]} | {m[3]} | {r[\"output_tokens_per_s\"]} |')" $j
done
