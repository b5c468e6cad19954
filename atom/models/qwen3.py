"""Qwen3: Llama's blocks with per-head RMSNorm on q and k."""

from atom.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
