"""Where a reasoning model's reasoning ends, as the engine sees it (token ids): structured
output constrains only what follows the end tag. The server's parsers split the text."""

from __future__ import annotations

from collections.abc import Sequence

# --reasoning-parser name -> (start tag, end tag), each one token in those models' vocabularies
REASONING_TAGS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}


def reasoning_tag_ids(name: str | None, tokenizer) -> tuple[int, int] | None:
    """The (start, end) token ids of the parser's tags, or None (no parser, or the
    vocabulary lacks them: then nothing is treated as reasoning)."""
    if name is None:
        return None
    ids = []
    for tag in REASONING_TAGS[name]:
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids.append(encoded[0])
    return ids[0], ids[1]


def prompt_ends_reasoning(prompt_token_ids: Sequence[int], tag_ids: tuple[int, int]) -> bool:
    """Whether the prompt already closed the reasoning (Qwen3's template with thinking off
    ends in ``<think></think>``): the end tag after the last start tag. A prompt that opens
    ``<think>`` (DeepSeek-R1's template) or has no tag leaves the output to reason first."""
    start, end = tag_ids
    last_start = max((i for i, t in enumerate(prompt_token_ids) if t == start), default=-1)
    return any(t == end for t in prompt_token_ids[last_start + 1 :]) if last_start >= 0 else False
