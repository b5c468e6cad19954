#!/usr/bin/env bash
# vLLM native against vLLM + atom's plugin on the throughput workload, one model after another,
# in the same machine session (run through the device tool from the repo root, after vLLM 0.26.0
# is installed in /tmp/site: ../shared/tools/vllm-gpu/README.md). Writes atom's entry points as a
# dist-info directory (docs/plugin.md), then per model: native, plugin, the tok/s, and from the
# plugin's log the platform line, atom's kernel warm-up and any kernel vLLM saw compiled during
# inference (there should be none). Logs and JSON in $OUT.
#     bash tests/gpu/plugin_compare.sh qwen3-0.6b qwen3-8b
# ORDER (default "1 0 0 1": native, plugin, plugin, native) lists the runs per model by their
# ATOM_DISABLE_VLLM_PLUGIN value: a run's position in the machine session moves its throughput
# (session 16: two runs of one setting 5-8% apart, more than plugin vs native), so a pair in one
# order charges that to one side; the last table gives each setting's mean and their ratio. The
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
$py - $out/tput_*_plugin_off*.json <<'PY'
import json, re, sys
from collections import defaultdict
means = defaultdict(lambda: defaultdict(list))
for path in sys.argv[1:]:
    m = re.match(r".*/tput_(.+)_(\d+)_plugin_off(\d)", path)
    tps = json.load(open(path))["output_tokens_per_s"]
    means[m[1]][m[3]].append(tps)
    print(f"| {m[1]} | {m[2]} | {m[3]} | {tps} |")
for model, runs in means.items():
    if runs["0"] and runs["1"]:
        plugin, native = (sum(v) / len(v) for v in (runs["0"], runs["1"]))
        print(f"{model}: plugin {plugin:.1f} tok/s (mean of {len(runs['0'])}), native {native:.1f} "
              f"(mean of {len(runs['1'])}): plugin / native {plugin / native:.3f}")
PY
