"""Per-request sampling parameters (the serving guide's fields plus vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    max_tokens: int = 64
    ignore_eos: bool = False
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None  # stop strings, not included in the text
    stop_strings: list[str] | None = None  # the serving guide's name for `stop`
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top-N logprobs of each sampled position
    prompt_logprobs: int | None = None  # top-N logprobs of each prompt position

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or []) + [s for s in (self.stop_strings or []) if s not in (self.stop or [])]
        self.stop_strings = self.stop
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 or -1 disables it)"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative ints"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, "must be >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")
