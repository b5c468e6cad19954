"""Compile grammars for one tokenizer off the engine loop, and cache them.

``submit`` returns at once with a future; a worker thread compiles (xgrammar releases the
GIL while it does), so the engine keeps stepping other requests and checks ``future.done()``
before scheduling the constrained one. The same spec is compiled once: later requests get the
cached future.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from atom.structured_output.spec import GrammarSpec
from atom.structured_output.xgrammar_import import xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar 0.2.8 writes the characters of a length-bounded JSON string (minLength/maxLength)
# as this class, which lets raw control characters through: invalid JSON (RFC 8259 wants
# them escaped). Its unbounded strings already exclude them.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
# whitespace characters allowed between two JSON tokens: enough for pretty-printed nesting, and
# a model cannot spend its whole max_tokens on whitespace (the output still parses)
MAX_JSON_WHITESPACE = 20


def json_strings_without_control_chars(grammar: xgr.Grammar) -> xgr.Grammar:
    """The JSON-schema grammar with no raw control character allowed inside any string."""
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgrammar().Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


class GrammarCompiler:
    def __init__(
        self,
        tokenizer,
        vocab_size: int | None = None,
        *,
        any_whitespace: bool = True,
        max_workers: int = 1,
        cache_size: int = 256,
    ):
        """``vocab_size``: the model's logits width when it exceeds the tokenizer's (padding);
        ``any_whitespace=False`` is vLLM's ``--structured-outputs-config.disable_any_whitespace``."""
        xgr = xgrammar()
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_workers)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="atom-grammar")
        self._any_whitespace = any_whitespace
        self._cache: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # submit may be called from the server and the engine threads

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def submit(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """A future of the compiled grammar; a bad spec fails the future with ValueError."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Blocking: the compiled grammar (or ValueError)."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        spec.validate()  # a spec that does not parse, or that xgrammar would not enforce: ValueError
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.spec if spec.kind == "json" else json.dumps({"type": "object"})
                grammar = xgrammar().Grammar.from_json_schema(
                    schema,
                    any_whitespace=self._any_whitespace and spec.any_whitespace,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE,
                )
                return self._compiler.compile_grammar(json_strings_without_control_chars(grammar))
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.spec)
            return self._compiler.compile_grammar(spec.grammar_text())
        except RuntimeError as error:
            raise ValueError(f"Could not compile the {spec.kind} grammar: {error}") from error
