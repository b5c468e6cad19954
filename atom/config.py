"""Typed engine configuration, validated at construction and never mutated afterwards.

Sizes measured at start-up (how many KV blocks fit) are returned by the model runner
to whoever asked, not written back here. Each value lives in one place: ``max_model_len``
in ``ModelConfig`` only, and these dataclasses' defaults are ``EngineArgs``' defaults.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
# "auto"/"bf16": the model dtype; "fp8" (vLLM's alias "fp8_e4m3"): e4m3 with per-layer scales
KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "fp8_e4m3")
DEFAULT_CUDAGRAPH_SIZES = [1, 2, 4, 8] + list(range(16, 257, 16))
# vLLM's CUDA-graph modes: full graphs of decode batches, and piecewise graphs (attention eager,
# the rest captured) of mixed prefill + decode batches up to the largest piecewise size
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE")
# token counts mixed batches are padded to: fine steps where a prefill chunk is cheap, 128-token
# steps up to 2048 (beyond, a step's GPU time exceeds its launch time, which async scheduling hides)
DEFAULT_PIECEWISE_SIZES = [16, 32, 48, 64, 96, 128, 192, 256] + list(range(384, 2049, 128))


def resolve_dtype(dtype: str | torch.dtype, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (bf16 when it says float32 on a GPU, like vLLM);
    on the CPU half precision is slow and inexact, so ``auto`` gives float32 there."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = _DTYPES.get(cfg_dtype, torch.bfloat16)
    return cfg_dtype if cfg_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def sliding_window(hf_config: PretrainedConfig) -> int | None:
    """The attention window of a model with sliding-window layers (Mistral; Qwen2 with
    ``use_sliding_window``), else None. atom attends to the whole sequence, which is the same
    as long as no sequence is longer than the window."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None  # Qwen2/Qwen3 configs carry a window they do not use
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


@dataclass(frozen=True)
class ModelConfig:
    model: str
    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    tokenizer: str
    trust_remote_code: bool = False
    load_dummy: bool = False
    seed: int = 0
    quantization: str | None = None  # "fp8": quantise a high-precision checkpoint on load
    # vLLM's --generation-config: "auto" (the model's generation_config.json recommends the
    # sampling defaults), "vllm" (none), or a folder holding a generation_config.json
    generation_config: str = "auto"
    # vLLM's --max-logprobs: the most logprobs (and prompt logprobs) a request may ask for per
    # position; -1: no cap (the vocabulary)
    max_logprobs: int = 20

    def __post_init__(self):
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or at least 0, got {self.max_logprobs}")
        if limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's "
                f"max_position_embeddings ({limit})"
            )
        window = sliding_window(self.hf_config)
        if window is not None and self.max_model_len > window:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is longer than the model's sliding attention window "
                f"({window}); atom does not implement sliding-window attention, so it serves this model up to "
                f"--max-model-len {window} (where full attention is the same)"
            )

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["<none>"])[0]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "bf16"
    enable_prefix_caching: bool = False
    gpu_memory_utilization: float = 0.9
    # CPU: bytes of KV cache (the GPU measures free memory instead); None = 2 GiB
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ValueError(f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    scheduler_delay_factor: float = 0.0
    # schedule and launch step N+1 before waiting for step N's tokens (vLLM's name); on by
    # default: measured faster offline and in serving (docs/performance.md)
    async_scheduling: bool = True
    # False (vLLM's --no-enable-chunked-prefill): a prompt is scheduled whole or waits
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.scheduler_delay_factor < 0:
            raise ValueError(f"scheduler_delay_factor must be >= 0, got {self.scheduler_delay_factor}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0  # this replica's index; set per engine-core process
    enable_expert_parallel: bool = False
    enable_dp_attention: bool = False
    disable_custom_all_reduce: bool = False  # GPUs: NCCL for every all-reduce (vLLM's flag)
    dp_init_method: str | None = None  # data-parallel attention: the replicas' rendezvous; set per launch

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} outside [0, {self.data_parallel_size})")


@dataclass(frozen=True)
class CompilationConfig:
    level: int = 3
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] = tuple(DEFAULT_CUDAGRAPH_SIZES)
    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    piecewise_capture_sizes: tuple[int, ...] = tuple(DEFAULT_PIECEWISE_SIZES)

    def __post_init__(self):
        if self.level not in (0, 1, 2, 3):
            raise ValueError(f"level must be 0, 1, 2 or 3, got {self.level}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}")
        for name in ("cudagraph_capture_sizes", "piecewise_capture_sizes"):
            sizes = getattr(self, name)
            if not sizes or min(sizes) <= 0:
                raise ValueError(f"{name} must be positive sizes, got {sizes}")


SPECULATIVE_METHODS = ("mtp", "shared_weights")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``mtp``: the checkpoint's next-n prediction layers draft; ``shared_weights``: a test
    mode whose draft is the target model itself (acceptance ~100% for greedy)."""

    method: str | None = None
    num_speculative_tokens: int = 1

    def __post_init__(self):
        if self.method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(f"method must be None or one of {', '.join(SPECULATIVE_METHODS)}; got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")

    @property
    def num_lookahead(self) -> int:
        """Draft tokens per step (0 without speculative decoding)."""
        return self.num_speculative_tokens if self.method is not None else 0


@dataclass(frozen=True)
class Config:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    torch_profiler_dir: str | None = field(default_factory=lambda: os.environ.get("ATOM_TORCH_PROFILER_DIR"))
    reasoning_parser: str | None = None  # structured output waits for the end of the reasoning

    def __post_init__(self):
        self._refuse_unbuilt()
        self._check_parallel()
        self._check_speculative()
        sc, max_len = self.scheduler_config, self.model_config.max_model_len
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < max_len:
            raise ValueError(f"max_num_batched_tokens ({sc.max_num_batched_tokens}) is smaller than max_model_len "
                             f"({max_len}): without chunked prefill a prompt of max_model_len tokens could never be "
                             "scheduled; raise --max-num-batched-tokens or lower --max-model-len")

    def _refuse_unbuilt(self) -> None:
        """Arguments whose feature is not built yet fail loudly rather than being ignored."""
        pc = self.parallel_config
        unbuilt = {
            "enable_dp_attention with tensor_parallel_size > 1": pc.enable_dp_attention and pc.tensor_parallel_size > 1,
            "enable_dp_attention with speculative decoding": pc.enable_dp_attention
            and self.speculative_config.method is not None,
        }
        missing = [name for name, used in unbuilt.items() if used]
        if missing:
            raise NotImplementedError(f"not implemented yet in atom: {', '.join(missing)}")

    def _check_dp_attention(self) -> None:
        pc, hf = self.parallel_config, self.model_config.hf_config
        experts = getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None)
        if pc.data_parallel_size < 2:
            raise ValueError("enable_dp_attention needs data_parallel_size >= 2 (-dp N): the experts are spread over "
                             "the replicas")
        if not experts:
            raise ValueError("enable_dp_attention is for mixture-of-experts models; this model has no experts")
        if experts % pc.data_parallel_size:
            raise ValueError(f"num_experts ({experts}) must be divisible by data_parallel_size "
                             f"({pc.data_parallel_size}) with enable_dp_attention")
        if self.device.type == "cuda" and not (self.compilation_config.enforce_eager
                                               and self.compilation_config.level == 0):
            raise ValueError("enable_dp_attention runs eagerly for now: enforce_eager=True and level=0 (the "
                             "replicas' batches differ in size and cannot share captured graphs yet)")

    def _check_speculative(self) -> None:
        if self.speculative_config.method == "mtp" and not getattr(self.model_config.hf_config,
                                                                   "num_nextn_predict_layers", 0):
            raise ValueError(f"method='mtp' needs a checkpoint with MTP layers, and {self.model_config.model!r} has "
                             "none (its config has no num_nextn_predict_layers); method='shared_weights' runs the "
                             "speculative path with the target model as its own draft")

    def _check_parallel(self) -> None:
        """The model must split evenly over the ranks; checked here, before any rank starts
        (the layers check it too, but only inside a rank process)."""
        tp, pc = self.parallel_config.tensor_parallel_size, self.parallel_config
        hf = self.model_config.hf_config
        if self.device.type == "cuda" and tp * pc.data_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size x data_parallel_size ({tp} x {pc.data_parallel_size}) is larger "
                             f"than the {torch.cuda.device_count()} visible GPUs")
        if pc.enable_dp_attention:
            self._check_dp_attention()
        if tp == 1:
            if pc.enable_expert_parallel:
                logger.info("enable_expert_parallel with one rank: every expert stays on it")
            return
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        if heads % tp:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by tensor_parallel_size ({tp})")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"num_key_value_heads ({kv_heads}) and tensor_parallel_size ({tp}) must divide one "
                             "another")
        num_experts = getattr(hf, "num_experts", None)
        if num_experts and pc.enable_expert_parallel and num_experts % tp:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by tensor_parallel_size ({tp}) with "
                             "enable_expert_parallel")
        moe_inter = getattr(hf, "moe_intermediate_size", None)
        if num_experts and moe_inter and not pc.enable_expert_parallel and moe_inter % tp:
            raise ValueError(f"moe_intermediate_size ({moe_inter}) must be divisible by tensor_parallel_size ({tp}); "
                             "or use enable_expert_parallel")
