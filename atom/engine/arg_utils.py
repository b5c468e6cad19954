"""``EngineArgs``: every engine argument of the serving guide (table 7.4), as CLI flags and
as keyword arguments of ``LLMEngine``; turned into a validated ``Config``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from atom.config import (
    CUDAGRAPH_MODES,
    KV_CACHE_DTYPES,
    SPECULATIVE_METHODS,
    CacheConfig,
    CompilationConfig,
    Config,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_dtype,
    sliding_window,
)
from atom.layers.quantization.kv_cache import checkpoint_kv_cache_dtype
from atom.structured_output.reasoning import REASONING_TAGS

logger = logging.getLogger(__name__)
# what --compilation-config may set (the compilation flags of the same names)
COMPILATION_KEYS = ("level", "cudagraph_mode", "cudagraph_capture_sizes", "piecewise_capture_sizes")


@dataclass
class EngineArgs:
    """Defaults come from the config dataclasses (one place), and each config section is
    built from the arguments of its field names (``_section``)."""

    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False  # token-id prompts only; no text in outputs
    trust_remote_code: bool = ModelConfig.trust_remote_code
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    data_parallel_size: int = ParallelConfig.data_parallel_size
    data_parallel_rank: int = ParallelConfig.data_parallel_rank  # no flag: set for each replica by the engine
    dp_init_method: str | None = ParallelConfig.dp_init_method  # no flag: set per launch by the engine
    enforce_eager: bool = CompilationConfig.enforce_eager
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    port: int = 8006  # the guide's flag; accepted and unused (the core talks over IPC sockets)
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    block_size: int = CacheConfig.block_size
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int | None = None  # None: default_max_num_batched_tokens(device)
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    scheduler_delay_factor: float = SchedulerConfig.scheduler_delay_factor
    async_scheduling: bool = SchedulerConfig.async_scheduling
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    cudagraph_capture_sizes: list[int] = field(default_factory=lambda: list(CompilationConfig.cudagraph_capture_sizes))
    level: int = CompilationConfig.level
    cudagraph_mode: str = CompilationConfig.cudagraph_mode
    piecewise_capture_sizes: list[int] = field(default_factory=lambda: list(CompilationConfig.piecewise_capture_sizes))
    compilation_config: dict | None = None  # vLLM's form: {"cudagraph_mode": "FULL_AND_PIECEWISE", ...}
    load_dummy: bool = ModelConfig.load_dummy
    enable_expert_parallel: bool = ParallelConfig.enable_expert_parallel
    enable_dp_attention: bool = ParallelConfig.enable_dp_attention
    disable_custom_all_reduce: bool = ParallelConfig.disable_custom_all_reduce
    torch_profiler_dir: str | None = None
    method: str | None = SpeculativeConfig.method
    num_speculative_tokens: int = SpeculativeConfig.num_speculative_tokens
    speculative_config: dict | None = None  # vLLM's form: {"method": "mtp", "num_speculative_tokens": 2}
    # beyond the guide's table: what vLLM users expect
    dtype: str = "auto"
    seed: int = ModelConfig.seed
    quantization: str | None = ModelConfig.quantization
    device: str = "auto"
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    # structured output starts after the reasoning of a reasoning model (vLLM's --reasoning-parser)
    reasoning_parser: str | None = None
    generation_config: str = ModelConfig.generation_config
    max_logprobs: int = ModelConfig.max_logprobs

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        a = parser.add_argument
        a("--model", type=str, default=d.model, help="HF model directory or .gguf file (default: embedded model)")
        a("--tokenizer", type=str, default=None, help="tokenizer path (default: the model's)")
        a("--skip-tokenizer-init", action="store_true", help="no tokenizer: token-id prompts, no output text")
        a("--trust-remote-code", action="store_true", help="trust remote code from Hugging Face")
        a("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
        a("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size)
        a("--enforce-eager", action="store_true", help="disable CUDA graphs; run eagerly")
        a("--enable_prefix_caching", "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
          default=d.enable_prefix_caching, help="reuse the KV blocks of earlier prompts with the same prefix "
          "(off unless asked, as in the seed guide)")
        a("--port", type=int, default=d.port, help="internal engine communication port")
        a("--kv_cache_dtype", "--kv-cache-dtype", type=str, default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
      help="fp8 (alias fp8_e4m3): e4m3 KV cache with the checkpoint's k_scale/v_scale, else 1.0")
        a("--block-size", type=int, default=d.block_size)
        a("--max-model-len", type=int, default=None, help="maximum context length (default: from the HF config)")
        a("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
          help=f"tokens one step may schedule (default {SchedulerConfig.max_num_batched_tokens} on a GPU, "
               f"{CPU_MAX_NUM_BATCHED_TOKENS} on the CPU)")
        a("--max-num-seqs", type=int, default=d.max_num_seqs)
        a("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        a("--scheduler-delay-factor", type=float, default=d.scheduler_delay_factor)
        a("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
          help="overlap the host work of the next step (scheduling, input building) with the running step "
          "(default: on; --no-async-scheduling turns it off)")
        a("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill,
          help="split long prompts over steps (default: on; --no-enable-chunked-prefill schedules each prompt whole, "
               "which needs --max-num-batched-tokens >= --max-model-len)")
        a("--cudagraph-capture-sizes", type=str, default=json.dumps(d.cudagraph_capture_sizes),
          help="batch sizes captured as CUDA graphs, e.g. '[1,2,4,8]'")
        a("--level", type=int, default=d.level, choices=[0, 1, 2, 3], help="compilation level; 3 = torch.compile")
        a("--cudagraph-mode", type=str, default=d.cudagraph_mode, choices=list(CUDAGRAPH_MODES),
          help="FULL_AND_PIECEWISE: full graphs for decode batches, piecewise ones (attention eager) for mixed "
               "batches up to the largest piecewise size; FULL_DECODE_ONLY: decode graphs only")
        a("--compilation-config", type=json.loads, default=None,
          help='vLLM\'s form, e.g. \'{"cudagraph_mode": "FULL_AND_PIECEWISE"}\'; keys: '
               + ", ".join(COMPILATION_KEYS))
        a("--load_dummy", "--load-dummy", action="store_true", help="random weights (no checkpoint needed)")
        a("--enable-expert-parallel", action="store_true")
        a("--enable-dp-attention", action="store_true")
        a("--disable-custom-all-reduce", action="store_true",
          help="GPUs: NCCL for every all-reduce, no one-shot all-reduce over symmetric memory for small messages")
        a("--torch-profiler-dir", type=str, default=None)
        a("--method", type=str, default=None, choices=list(SPECULATIVE_METHODS),
          help="speculative decoding method (shared_weights: a test mode, the target drafts for itself)")
        a("--num-speculative-tokens", type=int, default=d.num_speculative_tokens)
        a("--speculative-config", type=json.loads, default=None,
          help='vLLM\'s form, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\'')
        a("--dtype", type=str, default=d.dtype, choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
        a("--seed", type=int, default=d.seed)
        a("--quantization", "-q", type=str, default=None, choices=["fp8"],
          help="fp8: quantise a bf16 checkpoint's weights on load (FP8 checkpoints need no flag)")
        a("--device", type=str, default=d.device, help="auto, cuda or cpu")
        a("--kv-cache-memory-bytes", type=int, default=None, help="KV cache size (CPU default 2 GiB)")
        a("--num-gpu-blocks-override", type=int, default=None)
        a("--generation-config", type=str, default=d.generation_config,
          help="sampling defaults for requests that leave them out: auto (the model's generation_config.json: "
               "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm (none), or a folder "
               "with a generation_config.json")
        a("--max-logprobs", type=int, default=d.max_logprobs,
          help="the most logprobs a request may ask for per token (completions' logprobs, chat's top_logprobs); "
               "more is a 400; -1: no cap (the vocabulary)")
        a("--reasoning-parser", type=str, default=None, choices=sorted(REASONING_TAGS),
          help="the model reasons in <think>...</think> first: the server returns it as reasoning (and "
               "reasoning_content) and "
               "structured output constrains only what follows")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        sizes = kwargs.get("cudagraph_capture_sizes")
        if isinstance(sizes, str):
            kwargs["cudagraph_capture_sizes"] = [int(x) for x in sizes.strip("[]").split(",") if x.strip()]
        return cls(**kwargs)

    def resolved_model(self) -> str:
        if self.model is not None:
            return self.model
        from atom.model_loader.default_model import default_model_path

        return default_model_path()

    def _dp_attention_eager(self, device: torch.device) -> dict:
        """Data-parallel attention runs eagerly on GPUs for now: the replicas' batches differ
        in size, and captured graphs would need them padded to one size."""
        if not (self.enable_dp_attention and device.type == "cuda"):
            return {}
        if not (self.enforce_eager and self.level == 0):
            logger.warning("enable_dp_attention: running eagerly (no CUDA graphs, no torch.compile) for now")
        return dict(enforce_eager=True, level=0)

    def create_engine_config(self) -> Config:
        model = self.resolved_model()
        hf_config = load_hf_config(model, self.trust_remote_code)
        device = torch.device("cuda" if self.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if self.device == "auto" else self.device))
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1 (leave it out for the model's own), "
                             f"got {self.max_model_len}")
        max_len = self.max_model_len or default_max_model_len(hf_config)
        model_config = ModelConfig(
            model=model,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config, device),
            max_model_len=max_len,
            tokenizer=self.tokenizer or model,
            trust_remote_code=self.trust_remote_code,
            load_dummy=self.load_dummy,
            seed=self.seed,
            quantization=self.quantization,
            generation_config=self.generation_config,
            max_logprobs=self.max_logprobs,
        )
        return Config(
            model_config=model_config,
            cache_config=self._section(CacheConfig, kv_cache_dtype=self._kv_cache_dtype(hf_config)),
            scheduler_config=self._section(SchedulerConfig, max_num_batched_tokens=self.max_num_batched_tokens
                                           or default_max_num_batched_tokens(device)),
            parallel_config=self._section(ParallelConfig),
            compilation_config=self._compilation_section(device),
            speculative_config=self._speculative_section(),
            device=device,
            torch_profiler_dir=self.torch_profiler_dir or os.environ.get("ATOM_TORCH_PROFILER_DIR"),
            reasoning_parser=self.reasoning_parser,
        )

    def _kv_cache_dtype(self, hf_config: PretrainedConfig) -> str:
        """``auto``: the checkpoint's declared KV cache (an fp8 scheme, as vLLM reads it), else
        the model's dtype."""
        declared = checkpoint_kv_cache_dtype(hf_config) if self.kv_cache_dtype == "auto" else None
        if declared is not None:
            logger.info("--kv-cache-dtype auto: the checkpoint declares an %s KV cache", declared)
        return declared or self.kv_cache_dtype

    def _compilation_section(self, device: torch.device) -> CompilationConfig:
        """The compilation flags, overridden by vLLM's ``compilation_config`` dict where it sets them."""
        values = dict(self.compilation_config or {})
        unknown = set(values) - set(COMPILATION_KEYS)
        if unknown:
            raise ValueError(f"compilation_config keys not supported: {sorted(unknown)} (supported: "
                             f"{', '.join(COMPILATION_KEYS)})")
        for name in ("cudagraph_capture_sizes", "piecewise_capture_sizes"):
            values[name] = tuple(values.get(name, getattr(self, name)))
        return self._section(CompilationConfig, **(values | self._dp_attention_eager(device)))

    def _speculative_section(self) -> SpeculativeConfig:
        """``method``/``num_speculative_tokens``, or vLLM's ``speculative_config`` dict."""
        if self.speculative_config is None:
            return self._section(SpeculativeConfig)
        spec = dict(self.speculative_config)
        if spec.get("method") == "deepseek_mtp":  # vLLM's older name
            spec["method"] = "mtp"
        unknown = set(spec) - {"method", "num_speculative_tokens"}
        if unknown:
            raise ValueError(f"speculative_config keys not supported: {sorted(unknown)} (supported: method, "
                             "num_speculative_tokens)")
        return SpeculativeConfig(**spec)

    def _section(self, cls, **overrides):
        """A config dataclass from the arguments of the same names."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(cls)}
        return cls(**(values | overrides))


# vLLM's CPU server budget: a 16,384-token prefill step takes minutes on a CPU, and every other
# request waits for it (decodes, a request's abort); 2,048-token chunks let them in between
CPU_MAX_NUM_BATCHED_TOKENS = 2048


def default_max_num_batched_tokens(device: torch.device) -> int:
    """The step's token budget when none is given: the seed's 16,384 on a GPU, 2,048 on the CPU."""
    return CPU_MAX_NUM_BATCHED_TOKENS if device.type == "cpu" else SchedulerConfig.max_num_batched_tokens


def default_max_model_len(hf_config: PretrainedConfig) -> int:
    """The model's context length; for a model with sliding-window layers at most the window
    (atom's attention is full attention: the same up to that length)."""
    max_len = getattr(hf_config, "max_position_embeddings", 4096)
    window = sliding_window(hf_config)
    if window is not None and window < max_len:
        arch = (getattr(hf_config, "architectures", None) or ["the model"])[0]
        logger.warning("%s uses sliding-window attention (window %d), which atom does not implement: "
                       "max_model_len %d instead of %d", arch, window, window, max_len)  # fmt: skip
        return window
    return max_len


def load_hf_config(model: str, trust_remote_code: bool = False) -> PretrainedConfig:
    from atom.model_loader.gguf import find_gguf_file, load_gguf_config

    gguf_file = find_gguf_file(model)
    if gguf_file is not None:
        return load_gguf_config(gguf_file)
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model {model!r} is not a local directory or .gguf file (atom does not download)")
    return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    from atom.model_loader.gguf import find_gguf_file, load_gguf_tokenizer

    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


# generation_config.json fields that become sampling defaults (vLLM's get_diff_sampling_param)
SAMPLING_DEFAULT_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def sampling_defaults(mc: ModelConfig) -> dict:
    """The sampling defaults the model recommends, as vLLM's ``--generation-config auto``
    applies them: the fields of ``SAMPLING_DEFAULT_FIELDS`` its generation_config.json sets
    (``max_new_tokens`` as ``max_tokens``); empty with ``vllm`` or without the file."""
    if mc.generation_config == "vllm":
        return {}
    folder = mc.model if mc.generation_config == "auto" else mc.generation_config
    try:
        values = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError):
        if mc.generation_config != "auto":
            raise ValueError(f"--generation-config {mc.generation_config}: no generation_config.json there") from None
        return {}
    defaults = {k: values[k] for k in SAMPLING_DEFAULT_FIELDS if values.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        logger.info("Default sampling parameters have been overridden by the model's generation config: %s "
                    "(--generation-config vllm keeps vLLM's)", defaults)
    return defaults


def eos_token_ids(model: str, hf_config: PretrainedConfig, tokenizer) -> tuple[int, ...]:
    """EOS ids as ``generate`` uses them: generation_config.json's, else the config's and the
    tokenizer's."""
    ids: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(model)
        ids += [gen.eos_token_id] if isinstance(gen.eos_token_id, int) else list(gen.eos_token_id or [])
    except (OSError, ValueError):
        pass
    if not ids:
        cfg = getattr(hf_config, "eos_token_id", None)
        ids += [cfg] if isinstance(cfg, int) else list(cfg or [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
