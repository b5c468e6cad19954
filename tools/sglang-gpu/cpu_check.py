"""CPU check of atom's SGLang wrapper inside real SGLang 0.5.17, no server: atom's Qwen3 and SGLang's own Qwen3, built
by SGLang's constructor call on one tiny fp32 checkpoint and loaded through SGLang's safetensors iterator, each run
through SGLang's torch_native attention backend over SGLang's KV pool (the mock model runner of SGLang's own
attention-test kit, ``sglang.test.kits.attention_unittest``): one prefill of two prompts, then one decode step.
Prints the largest logit difference per step. Needs SGLang importable on the CPU (README.md, "CPU check").

    PYTHONPATH=$SGL:$PWD .venv-vllm/bin/python tools/sglang-gpu/cpu_check.py /tmp/atom-tiny-qwen3
"""

from __future__ import annotations

import glob
import sys

import torch

MAX_LEN = 64
PROMPTS = [[5, 17, 33, 2, 91], [7, 7, 120, 55, 3, 200, 11]]


def init_sglang(model_path: str) -> None:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(1, 0, "tcp://127.0.0.1:29534", 0, "gloo")
    initialize_model_parallel(1, backend="gloo")
    args = ServerArgs(model_path=model_path, device="cpu", attention_backend="torch_native", sampling_backend="pytorch")
    get_context().set_server_args(args)
    initialize_dp_attention(args, ModelConfig.from_server_args(args))


def run(model_cls, model_path: str) -> list[torch.Tensor]:
    """Next-token logits of the prefill and of one greedy decode step."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    model = model_cls(config=cfg, quant_config=None).to(torch.float32).eval()
    model.load_weights(safetensors_weights_iterator(glob.glob(f"{model_path}/*.safetensors")))
    lens = tuple(map(len, PROMPTS))
    prefill = kit.DenseAttentionCase("prefill", "torch_native", ForwardMode.EXTEND, heads, kv_heads, 1, (0, 0), lens)
    decode = kit.DenseAttentionCase("decode", "torch_native", ForwardMode.DECODE, heads, kv_heads, 1, lens)
    tiny = kit.TinyModelConfig(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        context_len=MAX_LEN,
        sliding_window_size=None,
    )
    runner = kit.MockModelRunner(
        case=prefill, model_config=tiny, dtype=torch.float32, device="cpu", max_context_len=MAX_LEN, head_dim=head_dim
    )
    runner.token_to_kv_pool = MHATokenToKVPool(  # the kit's pool has one layer
        size=2 * MAX_LEN + 2,
        page_size=1,
        dtype=torch.float32,
        head_num=kv_heads,
        head_dim=head_dim,
        layer_num=cfg.num_hidden_layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    backend = ATTENTION_BACKENDS["torch_native"](runner)
    ids, out = sum(PROMPTS, []), []
    for case in (prefill, decode):
        batch = kit._make_forward_batch(case, runner, max_context_len=MAX_LEN, device="cpu")
        batch.input_ids = torch.tensor(ids, dtype=torch.int64)
        batch.req_to_token_pool, batch.token_to_kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
        batch.attn_backend, batch.return_logprob, batch.capture_hidden_mode = backend, False, CaptureHiddenMode.NULL
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            backend.init_forward_metadata(batch)
            logits = model(batch.input_ids, batch.positions, batch).next_token_logits
        out.append(logits)
        ids = logits.argmax(-1).tolist()
    return out


def main() -> None:
    from atom.testing.tiny_checkpoint import build

    path = build(sys.argv[1] if len(sys.argv) > 1 else "/tmp/atom-tiny-qwen3", "qwen3")
    init_sglang(path)
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM as SGLangQwen3

    import atom.plugin.sglang.models as atom_sglang

    ours, theirs = run(atom_sglang.Qwen3ForCausalLM, path), run(SGLangQwen3, path)
    for step, a, b in zip(("prefill", "decode"), ours, theirs):
        same = bool((a.argmax(-1) == b.argmax(-1)).all())
        print(
            f"{step}: logits {tuple(a.shape)}, max |atom - sglang| = {float((a - b).abs().max()):.3g}, "
            f"same argmax: {same}"
        )


if __name__ == "__main__":
    main()
