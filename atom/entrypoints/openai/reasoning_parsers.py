"""Reasoning in model output, as vLLM's ``--reasoning-parser qwen3`` splits it.

With thinking on (the default; ``chat_template_kwargs={"enable_thinking": false}`` turns it
off) the output is reasoning until ``</think>``: a ``<think>`` is dropped (the model writes
it, or the chat template already put it in the prompt), output that never closes the tag is
all reasoning, and ``<tool_call>`` also ends the reasoning (it stays in the content). A
repeated ``</think>`` in the content is dropped. With thinking off, everything is content.
"""

from __future__ import annotations

from atom.entrypoints.openai.parsed_output import DeltaMessage, partial_tag_overlap

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"


class Qwen3ReasoningParser:
    """Parses one response: ``extract`` a whole output, or ``extract_streaming`` each new
    piece of text and ``finish`` at the end (one parser per streamed response)."""

    def __init__(self, enable_thinking: bool = True) -> None:
        self.enable_thinking = enable_thinking
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def extract(self, output: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content), None for an empty part."""
        if not self.enable_thinking:
            return None, output or None
        reasoning, content = self._split(output, final=True)
        return reasoning or None, content if content else None

    def extract_streaming(self, delta_text: str) -> DeltaMessage | None:
        self._text += delta_text
        return self._delta(final=False)

    def finish(self) -> DeltaMessage | None:
        """What was held back at the end of the stream (a partial tag that never completed)."""
        return self._delta(final=True)

    @property
    def reasoning_ended(self) -> bool:
        """Whether the content has started (structured output and tool parsing apply from there)."""
        return not self.enable_thinking or self._end(self._text)[0] >= 0

    def _delta(self, final: bool) -> DeltaMessage | None:
        if not self.enable_thinking:
            reasoning, content = "", self._text
        else:
            reasoning, content = self._split(self._text, final)
        new_reasoning, new_content = reasoning[self._sent_reasoning :], content[self._sent_content :]
        self._sent_reasoning, self._sent_content = len(reasoning), len(content)
        if new_reasoning or new_content:
            return DeltaMessage(content=new_content or None, reasoning_content=new_reasoning or None)
        return None

    @staticmethod
    def _end(text: str) -> tuple[int, int]:
        """(where the reasoning ends, where the content starts); (-1, -1) while it goes on."""
        end, tool = text.find(THINK_END), text.find(TOOL_CALL_START)
        if tool >= 0 and (end < 0 or tool < end):
            return tool, tool
        return (end, end + len(THINK_END)) if end >= 0 else (-1, -1)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """The reasoning and content of ``text``; unless ``final``, without a trailing partial
        tag (the next piece may complete it), so both only grow as the text does."""
        end, content_start = self._end(text)
        if end < 0:
            reasoning = text
            if not final:
                held = max(partial_tag_overlap(text, tag) for tag in (THINK_START, THINK_END, TOOL_CALL_START))
                reasoning = text[: len(text) - held]
            return reasoning.replace(THINK_START, ""), ""
        content = text[content_start:]
        if not final:
            content = content[: len(content) - partial_tag_overlap(content, THINK_END)]
        return text[:end].replace(THINK_START, ""), content.replace(THINK_END, "")


class DeepSeekR1ReasoningParser(Qwen3ReasoningParser):
    """vLLM's ``deepseek_r1``: the chat template opens ``<think>`` in the prompt and the model
    closes it; there is no switch to turn thinking off."""

    def __init__(self, enable_thinking: bool = True) -> None:
        super().__init__(enable_thinking=True)


# the names match the engine's (atom.structured_output.reasoning.REASONING_TAGS)
REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}
