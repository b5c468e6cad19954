"""Per-request sampling parameters (the serving guide's fields plus vLLM's).

``SamplingParams`` validates every field against what the engine can represent (a seed
feeds a 64-bit ``torch.Generator``, ``top_k`` an int32 tensor), so that a bad value is a
``ValueError`` naming the field here, for the offline API and the server alike, and never
an error inside a kernel.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

logger = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
# below this a temperature overflows the scaled logits to inf (vLLM clamps the same way)
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
    schema (a dict or its text), a regex, a list of choices, an EBNF grammar, or any JSON
    object. The grammar engine (xgrammar) compiles it in the engine core."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) or 'none'}"
            )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    max_tokens: int | None = 64  # None: as many as the context leaves (vLLM's), set when the request is added
    ignore_eos: bool = False
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # a signed 64-bit integer
    stop: list[str] | str | None = None  # stop strings, not included in the text
    stop_strings: list[str] | None = None  # the serving guide's name for `stop`
    stop_token_ids: list[int] = field(default_factory=list)  # the stop token's text is not in the output either
    include_stop_str_in_output: bool = False  # vLLM's: keep the stop string (or stop token's text) in the text
    skip_special_tokens: bool = True  # vLLM's: leave special tokens out of the text
    logprobs: int | None = None  # top-N logprobs of each sampled position
    prompt_logprobs: int | None = None  # top-N logprobs of each prompt position
    # logits processing (vLLM's names and semantics, applied before temperature)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias, clamped to [-100, 100]
    min_tokens: int = 0  # no stop id (EOS included) before this many output tokens
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # ``bad_words`` as token ids, set by the engine from its tokenizer (vLLM's update_from_tokenizer)
    bad_words_token_ids: list[list[int]] | None = None
    # output constrained by a grammar (vLLM's field name)
    structured_outputs: StructuredOutputsParams | None = None
    # samples per prompt (vLLM's; last, so that positional arguments keep their places): each
    # its own engine request, with the params ``sample(i)`` gives
    n: int = 1

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or []) + [s for s in (self.stop_strings or []) if s not in (self.stop or [])]
        self.stop_strings = self.stop
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.logit_bias:
            self.logit_bias = {int(k): min(100.0, max(-100.0, float(v))) for k, v in self.logit_bias.items()}
        if self.bad_words:
            self.bad_words = list(dict.fromkeys(self.bad_words))
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %g is below %g and is raised to it, as too small a value overflows",
                self.temperature,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE

    def _validate(self) -> None:
        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def count(v, lo, hi) -> bool:
            return _is_int(v) and lo <= v <= hi

        checks = [
            ("n", count(self.n, 1, INT32_MAX), f"must be an int in [1, {INT32_MAX}]"),
            ("temperature", number(self.temperature) and self.temperature >= 0, "must be a finite number >= 0"),
            ("top_p", number(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", count(self.top_k, 0, INT32_MAX), f"must be in [0, {INT32_MAX}] (0 or -1 disables it)"),
            ("min_p", number(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", self.max_tokens is None or count(self.max_tokens, 1, INT64_MAX),
             f"must be None or an int in [1, {INT64_MAX}]"),
            (
                "seed",
                self.seed is None or count(self.seed, INT64_MIN, INT64_MAX),
                f"must be a signed 64-bit int in [{INT64_MIN}, {INT64_MAX}]",
            ),
            (
                "seed",
                not (_is_int(self.seed) and _is_int(self.n)) or self.seed + self.n - 1 <= INT64_MAX,
                f"+ n - 1 must be at most {INT64_MAX} (sample i gets seed + i)",
            ),
            (
                "stop",
                all(isinstance(s, str) and s and is_encodable(s) for s in self.stop),
                "must be non-empty strings of valid Unicode (no lone surrogates)",
            ),
            ("stop_token_ids", all(count(t, 0, INT64_MAX) for t in self.stop_token_ids), "must be non-negative ints"),
            (
                "logprobs",
                self.logprobs is None or count(self.logprobs, 0, INT64_MAX),
                "must be None or an int >= 0 (at most the engine's max_logprobs)",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or count(self.prompt_logprobs, 0, INT64_MAX),
                "must be None or an int >= 0 (at most the engine's max_logprobs)",
            ),
        ]
        checks += self._processing_checks(number, count)
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {_short(getattr(self, name))}")

    def _processing_checks(self, number, count) -> list[tuple[str, bool, str]]:
        bias = self.logit_bias
        return [
            (
                "presence_penalty",
                number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                "must be in [-2, 2]",
            ),
            (
                "frequency_penalty",
                number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "must be in [-2, 2]",
            ),
            (
                "repetition_penalty",
                number(self.repetition_penalty) and self.repetition_penalty > 0,
                "must be a finite number > 0",
            ),
            (
                "logit_bias",
                bias is None or (isinstance(bias, dict) and all(_int_key(k) and number(v) for k, v in bias.items())),
                "must map token ids (ints >= 0) to finite numbers",
            ),
            (
                "min_tokens",
                count(self.min_tokens, 0, INT64_MAX)
                and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
                "must be an int in [0, max_tokens]",
            ),
            (
                "bad_words",
                self.bad_words is None
                or (
                    isinstance(self.bad_words, list)
                    and all(isinstance(w, str) and w.strip() and is_encodable(w) for w in self.bad_words)
                ),
                "must be a list of non-empty strings",
            ),
            (
                "structured_outputs",
                self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                "must be a StructuredOutputsParams",
            ),
            (
                "allowed_token_ids",
                self.allowed_token_ids is None
                or (
                    isinstance(self.allowed_token_ids, list)
                    and self.allowed_token_ids
                    and all(count(t, 0, INT64_MAX) for t in self.allowed_token_ids)
                ),
                "must be a non-empty list of token ids (ints >= 0)",
            ),
        ]

    def sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n`` (vLLM's child request): n=1, and a given seed
        made ``seed + index``, so that the samples differ and each is reproducible."""
        if self.n == 1 and (self.seed is None or index == 0):
            return self
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    def check_token_ids(self, vocab_size: int) -> None:
        """The token-id fields against the vocabulary (known only to the engine)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= int(t) < vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token ids out of range [0, {vocab_size}): {_short(bad)}")

    @property
    def uses_history(self) -> bool:
        """Whether the logits processing of a step depends on the tokens sampled so far
        (a grammar's mask depends on them too)."""
        return self._penalizes_history or self.structured_outputs is not None

    @property
    def _penalizes_history(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or self.min_tokens > 0
            or bool(self.bad_words)
        )

    @property
    def processes_logits(self) -> bool:
        """Whether penalties, logit_bias or token masks apply (the grammar's mask aside)."""
        return self._penalizes_history or bool(self.logit_bias) or self.allowed_token_ids is not None


def _int_key(k) -> bool:
    """A logit_bias key: an int, or a string of one (the protocol's JSON keys)."""
    try:
        return int(k) >= 0 and not isinstance(k, (bool, float))
    except (TypeError, ValueError):
        return False


def is_encodable(s: str) -> bool:
    """True if ``s`` can be encoded as UTF-8 (no lone surrogates such as "\\ud800")."""
    if s.isascii():  # O(1) in CPython
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(value) -> str:
    """A value for an error message: bounded in length and printable."""
    try:
        text = ascii(value)
    except ValueError:  # an int too long to print
        return "a number too large to print"
    return text if len(text) <= 60 else text[:57] + "..."
