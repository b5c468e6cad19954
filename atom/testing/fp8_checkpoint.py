"""Write FP8 versions of a (tiny) high-precision checkpoint, in the formats atom loads, and
the float32 checkpoint of the same weights dequantised, which the FP8 model must match.

    python -m atom.testing.fp8_checkpoint SRC DST --format block
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from atom.ops import reference_fp8 as fp8

# the GEMM weights of the decoder layers, MTP layers included: attention (MLA's too), dense
# MLPs, experts and shared experts. As in DeepSeek-V3/R1's checkpoint, the embedding, LM head,
# norms, router (mlp.gate, e_score_correction_bias) and the MTP layer's eh_proj and
# shared_head stay in high precision.
_LINEAR = re.compile(r"\.(?:(?:q|k|v|o|gate|up|down|q_a|q_b|kv_b)_proj|kv_a_proj_with_mqa)\.weight$")
FORMATS = ("block", "tensor", "channel", "ct_block")


def _quantize(w: torch.Tensor, fmt: str, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, the checkpoint's scale tensor, the dequantised float32 weight)."""
    if fmt == "tensor":
        scale = (w.abs().max().float() / fp8.FP8_MAX).clamp(min=fp8.SCALE_MIN)
        q = (w.float() / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        return q, scale, q.float() * scale
    if fmt == "channel":
        q, s = fp8.quantize_weight(w)
        return q, s, fp8.dequantize(q, s, 0)
    q, s = fp8.quantize_weight(w, block, block)
    return q, s[::block].contiguous(), fp8.dequantize(q, s, block)


def _quantization_config(fmt: str, block: int) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [block, block]}
    if fmt == "tensor":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel" if fmt == "channel" else "block"}
    if fmt == "ct_block":
        weights["block_structure"] = [block, block]
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
            "strategy": "token" if fmt == "channel" else "group", "group_size": block}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def write(src: str, dst: str, fmt: str, dequantized_dst: str | None = None, block: int = 128,
          ignore: tuple[str, ...] = ()) -> str:  # fmt: skip
    """FP8 checkpoint of ``src`` in ``fmt`` at ``dst``; with ``dequantized_dst``, also the float32
    checkpoint of the dequantised weights there. ``ignore``: module names (``model.layers.1.mlp``)
    left in high precision, listed in the quantization config as checkpoints list them."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}")
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if not _LINEAR.search(name) or name[: -len(".weight")] in ignore:
            quantized[name] = dequantized[name] = w
            continue
        q, scale, deq = _quantize(w, fmt, block)
        quantized[name] = q
        quantized[name + ("_scale_inv" if fmt == "block" else "_scale")] = scale
        if fmt == "tensor":  # vLLM's static activation scale (atom quantises activations dynamically)
            quantized[name[: -len("weight")] + "input_scale"] = torch.tensor(1.0)
        if dequantized_dst is not None:  # a real model (V2-Lite) is held in memory: only when asked
            dequantized[name] = deq.to(w.dtype)
    config_qc = _quantization_config(fmt, block)
    if ignore:
        key = "ignore" if config_qc["quant_method"] == "compressed-tensors" else "ignored_layers"
        config_qc[key] = [*config_qc.get(key, []), *ignore]
    for out, weights, qc in ((dst, quantized, config_qc), (dequantized_dst, dequantized, None)):
        if out is None:
            continue
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        if qc is not None:
            with open(os.path.join(out, "config.json")) as f:
                config = json.load(f)
            config["quantization_config"] = qc
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
    return dst


def add_kv_scales(src: str, dst: str, scales: dict[str, float]) -> str:
    """A copy of checkpoint ``src`` (one ``model.safetensors``) at ``dst`` with fp8 KV cache scales
    on every decoder layer: ``scales`` maps a name under ``model.layers.N.self_attn.`` (vLLM's
    ``k_scale``, ModelOpt's ``k_proj.k_scale``) to its value."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    with open(os.path.join(dst, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    tensors = load_file(path)
    tensors.update({f"model.layers.{i}.self_attn.{name}": torch.tensor(value)
                    for i in range(layers) for name, value in scales.items()})
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--format", choices=FORMATS, default="block")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--dequantized", default=None, help="also write the dequantised float32 checkpoint here")
    args = parser.parse_args()
    print(write(args.src, args.dst, args.format, args.dequantized, args.block))


if __name__ == "__main__":
    main()
