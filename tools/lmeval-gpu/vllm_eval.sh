#!/usr/bin/env bash
# Serves atom's default model (its cached safetensors conversion) with vLLM, runs `python -m atom.eval.accuracy
# --base-url` against it, and stops the server. On the GPU machine, after install.sh, from the project root:
#   bash tools/lmeval-gpu/vllm_eval.sh native $OUT/acc-vllm-native --tasks all --backends completions
#   bash tools/lmeval-gpu/vllm_eval.sh plugin $OUT/acc-vllm-atom   --tasks all --backends completions
# "native" sets ATOM_DISABLE_VLLM_PLUGIN=1; "plugin" puts atom's entry points on PYTHONPATH (the dist-info folder of
# docs/plugin.md) so vLLM runs atom's platform and model. Everything after the workdir goes to atom.eval.accuracy.
# PY (python), PORT (8000), VLLM_ARGS (extra vLLM server arguments; default "--dtype bfloat16") and
# STARTUP_S (600) override; the server log is WORKDIR/vllm.log.
set -euo pipefail
mode=$1; workdir=$2; shift 2
PY=${PY:-/opt/torch/.venv/bin/python3}
PORT=${PORT:-8000}
mkdir -p "$workdir"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
case $mode in
  native) export ATOM_DISABLE_VLLM_PLUGIN=1 ;;
  plugin)
    unset ATOM_DISABLE_VLLM_PLUGIN
    d=/tmp/atom_ep/atom_plugin_ep-0.1.0.dist-info; mkdir -p $d
    printf 'Metadata-Version: 2.1\nName: atom-plugin-ep\nVersion: 0.1.0\n' > $d/METADATA
    printf '[vllm.platform_plugins]\natom = atom.plugin.vllm.register:register_platform\n\n[vllm.general_plugins]\natom = atom.plugin.vllm.register:register_model\n' > $d/entry_points.txt
    export PYTHONPATH=${PYTHONPATH:-}:/tmp/atom_ep ;;
  *) echo "usage: vllm_eval.sh native|plugin WORKDIR [atom.eval.accuracy args]"; exit 2 ;;
esac
MODEL=$("$PY" -c "from atom.model_loader.default_model import default_model_path; print(default_model_path())")
echo "vLLM ($mode) serving $MODEL on port $PORT (log: $workdir/vllm.log)"
# shellcheck disable=SC2086
"$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
  ${VLLM_ARGS:---dtype bfloat16} > "$workdir/vllm.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
"$PY" - "$PORT" "${STARTUP_S:-600}" "$pid" <<'PY'
import os, sys, time, urllib.request

port, limit, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
t0 = time.monotonic()
while True:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        print(f"vLLM ready after {time.monotonic() - t0:.0f} s", flush=True)
        break
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("vLLM exited before it was ready (see vllm.log)")
        if time.monotonic() - t0 > limit:
            sys.exit(f"vLLM not ready after {limit:.0f} s")
        time.sleep(2)
PY
[ "$mode" = plugin ] && { grep -m3 "atom" "$workdir/vllm.log" || echo "WARNING: no atom line in vllm.log"; }
"$PY" -m atom.eval.accuracy --base-url "http://127.0.0.1:$PORT" --workdir "$workdir" "$@"
