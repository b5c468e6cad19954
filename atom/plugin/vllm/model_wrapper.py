"""atom's model classes with vLLM's model interface.

Each wrapper is a subclass of atom's own model class (same modules, same parameter names, same
``load_weights``), adapting only the constructor (``vllm_config``, ``prefix``) and ``forward``
(``intermediate_tensors``). Every atom attention layer gets a vLLM ``Attention`` layer attached,
named ``model.layers.N.self_attn.attn``: vLLM builds its metadata and owns its KV cache, and
its backend (atom's, unless switched off) runs the kernel. atom's layer still does q/k-norm
and RoPE itself. The wrappers carry vLLM's ``@support_torch_compile``: vLLM compiles them like
its own models (Dynamo traces atom's ops as opaque custom ops; vLLM's attention op is the
splitting point of its piecewise CUDA graphs).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from atom import ops
from atom.config import sliding_window
from atom.distributed.parallel_state import SINGLE, TPInfo
from atom.layers.attention import Attention as AtomAttention
from atom.layers.mla import MLAAttention
from atom.layers.quantization import filter_weights, get_fp8_config, process_weights_after_loading, quantize_layers
from atom.models.registry import get_model_class, plugin_architectures
from atom.plugin.vllm import attention_disabled, logger


def wrapper_name(arch: str) -> str:
    return f"ATOM{arch}"


class VllmTP(TPInfo):
    """vLLM's tensor-parallel group, reduced and gathered by vLLM's communicators (custom
    all-reduce, safe inside its CUDA graphs)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        from vllm.distributed import tensor_model_parallel_all_gather

        return tensor_model_parallel_all_gather(x.contiguous(), dim)


def vllm_tp(parallel) -> TPInfo:
    """This rank's place in vLLM's tensor-parallel group. ``--enable-expert-parallel`` places
    whole experts on the ranks of that group (atom's expert group is its tensor-parallel group,
    vLLM's too while ``-dp`` is 1)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group

    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return SINGLE
    return VllmTP(get_tensor_model_parallel_rank(), size, get_tp_group().device_group,
                  expert_parallel=getattr(parallel, "enable_expert_parallel", False))


def check_supported(vllm_config, arch: str) -> None:
    hf_config = vllm_config.model_config.hf_config
    parallel = vllm_config.parallel_config
    window, max_len = sliding_window(hf_config), vllm_config.model_config.max_model_len
    unsupported = [name for name, present in (
        ("pipeline parallelism", parallel.pipeline_parallel_size > 1),
        (f"quantization ({getattr(vllm_config.quant_config, 'get_name', lambda: '?')()})",
         vllm_config.quant_config is not None and atom_fp8_config(vllm_config) is None),
        ("LoRA", vllm_config.lora_config is not None),
        # atom's full attention is the window's up to the window's length
        (f"sliding-window attention beyond its {window}-token window (--max-model-len {max_len})",
         window is not None and max_len > window),
    ) if present]
    if unsupported:
        raise NotImplementedError(
            f"atom's {arch} inside vLLM does not support {', '.join(unsupported)}; "
            "set ATOM_DISABLE_VLLM_PLUGIN=1 to run vLLM's own implementation"
        )
    if getattr(parallel, "enable_expert_parallel", False) and parallel.data_parallel_size > 1:
        logger.warning("atom's %s places experts over each data-parallel replica's tensor-parallel group "
                       "(vLLM's own MoE layers would spread them over all %d ranks)",
                       arch, parallel.data_parallel_size * parallel.tensor_parallel_size)


def atom_fp8_config(vllm_config):
    """atom's FP8 scheme for vLLM's quantisation settings: the checkpoint's FP8 config, or
    ``--quantization fp8`` on an unquantised checkpoint; None if atom cannot run them."""
    if vllm_config.quant_config is None:
        return None
    hf_config = vllm_config.model_config.hf_config
    online = "fp8" if vllm_config.model_config.quantization == "fp8" else None
    try:
        return get_fp8_config(hf_config, None if getattr(hf_config, "quantization_config", None) else online)
    except ValueError:
        return None


def attach_vllm_attention(model: nn.Module, vllm_config, prefix: str = "") -> int:
    """Give every atom attention layer of ``model`` a vLLM ``Attention`` layer (an MLA layer
    vLLM's ``MLAAttention``); returns how many."""
    from atom.plugin.vllm.attention import VllmAttention

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, AtomAttention)]
    for name, layer in layers:
        host_prefix = f"{prefix}.{layer.prefix}" if prefix else layer.prefix
        if isinstance(layer, MLAAttention):
            host = vllm_mla_attention(layer, model.get_submodule(name.rpartition(".")[0]), vllm_config, host_prefix)
        else:
            host = VllmAttention(layer.num_heads, layer.head_dim, layer.scale, num_kv_heads=layer.num_kv_heads,
                                 cache_config=vllm_config.cache_config, quant_config=None, prefix=host_prefix)
        layer.attach_host_attention(host)
        # the host takes atom's loaded fp8 cache scales after loading (attention.use_atom_kv_scales)
        host.atom_layer = weakref.ref(layer)
    return len(layers)


def vllm_mla_attention(layer: MLAAttention, parent: nn.Module, vllm_config, prefix: str) -> nn.Module:
    """vLLM's MLA layer for atom's ``layer`` (``parent`` holds its ``kv_b_proj``), run by atom's
    MLA backend."""
    from atom.plugin.vllm.mla import ATOMMLABackend, VllmMLAAttention

    if attention_disabled():  # vLLM's MLA backends call vLLM's own linear layers
        raise NotImplementedError("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1 does not apply to atom's multi-head latent "
                                  "attention (DeepSeek); set ATOM_DISABLE_VLLM_PLUGIN=1 to run vLLM's DeepSeek")
    return VllmMLAAttention(num_heads=layer.num_heads, scale=layer.scale, qk_nope_head_dim=layer.nope,
                            qk_rope_head_dim=layer.rope, v_head_dim=layer.v_head_dim, q_lora_rank=parent.q_lora_rank,
                            kv_lora_rank=layer.kv_lora_rank, kv_b_proj=parent.kv_b_proj,
                            cache_config=vllm_config.cache_config, quant_config=None, prefix=prefix,
                            attn_backend=ATOMMLABackend)


class VllmModelAdapter:
    """Placed before an atom model class in the wrapper's bases."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        arch = type(self).atom_architecture
        check_supported(vllm_config, arch)
        # register atom's Triton custom ops now: registering them on first use would happen
        # inside Dynamo's trace
        ops.init_device_ops(vllm_config.device_config.device_type)
        super().__init__(vllm_config.model_config.hf_config, vllm_tp(vllm_config.parallel_config))
        fp8 = atom_fp8_config(vllm_config)
        if fp8 is not None:  # FP8 weights through atom's layers (docs/fp8.md)
            quantize_layers(self, fp8)
        n = attach_vllm_attention(self, vllm_config, prefix)
        host = "MLAAttention (atom's MLA backend)" if any(isinstance(m, MLAAttention) for m in self.modules()) \
            else "Attention"
        logger.info("atom model %s (%s) built for vLLM; its %d attention layers run through vLLM's %s",
                    type(self).__name__, type(self).atom_class.__module__, n, host)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return super().forward(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return super().compute_logits(hidden_states)

    def load_weights(self, weights) -> set[str]:
        # vLLM finishes only its own quantisation methods after loading; atom's are finished here
        loaded = super().load_weights(filter_weights(weights))
        process_weights_after_loading(self)
        return loaded


# batch (token) dimension of each forward input, for vLLM's torch.compile (the annotations are
# strings here, so vLLM cannot infer them)
DYNAMIC_ARG_DIMS = {"input_ids": 0, "positions": -1, "inputs_embeds": 0}


def _make_wrapper(arch: str) -> type[nn.Module]:
    from vllm.compilation.decorators import support_torch_compile

    base = get_model_class(arch)
    name = wrapper_name(arch)
    return support_torch_compile(dynamic_arg_dims=DYNAMIC_ARG_DIMS)(type(name, (VllmModelAdapter, base), {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"atom's {arch} ({base.__module__}) with vLLM's model interface.",
        "atom_architecture": arch,
        "atom_class": base,
    }))


for _arch in plugin_architectures(mla=True):
    globals()[wrapper_name(_arch)] = _make_wrapper(_arch)
del _arch
