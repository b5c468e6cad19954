"""What a request constrains its output to: one grammar kind and its text, as vLLM names them.

``GrammarSpec`` is the cache key of a compiled grammar. The request fields map onto it:
``response_format`` json_object / json_schema, and vLLM's ``structured_outputs`` (or the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from atom.structured_output.xgrammar_import import xgrammar

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: Kind
    spec: str  # JSON schema text, regex, JSON list of choices, or EBNF; "" for json_object
    any_whitespace: bool = True  # JSON: free whitespace between tokens (vLLM's disable_any_whitespace=False)

    @classmethod
    def from_options(
        cls,
        json_schema: str | Mapping[str, Any] | None = None,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        json_object: bool = False,
        any_whitespace: bool = True,
    ) -> GrammarSpec | None:
        """The one constraint given (None when none is); several at once are an error, as in vLLM."""
        given = [
            name
            for name, value in (("json", json_schema), ("regex", regex), ("choice", choice), ("grammar", grammar))
            if value is not None
        ] + (["json_object"] if json_object else [])
        if len(given) > 1:
            raise ValueError(f"Only one kind of structured output constraint may be given, got {', '.join(given)}")
        if not given:
            return None
        if json_schema is not None:
            text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema, sort_keys=True)
            return cls("json", text, any_whitespace)
        if regex is not None:
            return cls("regex", regex)
        if choice is not None:
            if not choice or not all(isinstance(c, str) for c in choice):
                raise ValueError("choice must be a non-empty list of strings")
            return cls("choice", json.dumps(list(choice)))
        if grammar is not None:
            return cls("grammar", grammar)
        return cls("json_object", "", any_whitespace)

    @classmethod
    def from_params(cls, params) -> GrammarSpec:
        """From ``SamplingParams.structured_outputs`` (a ``StructuredOutputsParams``)."""
        return cls.from_options(
            json_schema=params.json,
            regex=params.regex,
            choice=params.choice,
            grammar=params.grammar,
            json_object=bool(params.json_object),
            any_whitespace=not params.disable_any_whitespace,
        )

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None) -> GrammarSpec | None:
        """OpenAI's ``response_format``: {"type": "text" | "json_object" | "json_schema", ...}."""
        kind = (response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object", "")
        if kind == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            if schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            return cls.from_options(json_schema=schema)
        raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")

    def grammar_text(self) -> str:
        """The EBNF of a choice (its alternatives as literal strings); the spec otherwise."""
        if self.kind != "choice":
            return self.spec
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.spec))

    def validate(self) -> None:
        """Raise ValueError naming the problem if the spec does not parse (no tokenizer needed:
        cheap enough for the request handler, so a bad grammar never reaches the engine)."""
        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as error:
                raise ValueError(f"Invalid json for structured output: the schema is not JSON ({error})") from error
            unsupported = unsupported_json_features(schema)
            if unsupported:
                raise ValueError(
                    f"Invalid json for structured output: the schema uses {', '.join(unsupported)}, "
                    "which the grammar engine (xgrammar) cannot enforce"
                )
        xgr = xgrammar()
        try:
            if self.kind == "json":
                grammar = xgr.Grammar.from_json_schema(self.spec)
            elif self.kind == "regex":
                grammar = xgr.Grammar.from_regex(self.spec)
            elif self.kind in ("grammar", "choice"):
                grammar = xgr.Grammar.from_ebnf(self.grammar_text())
            else:
                return
            empty = admits_nothing(grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(f"Invalid {self.kind} for structured output: {_first_line(error)}") from error
        if empty:
            raise ValueError(f"Invalid {self.kind} for structured output: no output satisfies it")


@functools.cache
def _byte_compiler():
    """A grammar compiler over a vocabulary of the 256 bytes and a stop token: whatever text a
    grammar admits, this vocabulary can spell."""
    xgr = xgrammar()
    vocab = [bytes([i]) for i in range(256)] + [b"</s>"]
    return xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[256]))


def admits_nothing(grammar) -> bool:
    """Whether no output can even begin under ``grammar``: its first step allows no byte and
    no stop (a grammar that only recurses forever passes). Such a request would fail at its
    first token in the engine."""
    xgr = xgrammar()
    matcher = xgr.GrammarMatcher(_byte_compiler().compile_grammar(grammar))
    mask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(mask)
    return not bool(mask.any())


# String formats xgrammar enforces; any other format it would silently ignore.
_FORMATS = {
    "email",
    "date",
    "time",
    "date-time",
    "duration",
    "ipv4",
    "ipv6",
    "hostname",
    "uuid",
    "uri",
    "uri-reference",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
}


# keywords xgrammar accepts without enforcing them, wherever they appear
_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
            "patternProperties", "propertyNames")  # fmt: skip


def unsupported_json_features(schema: Any) -> list[str]:
    """Keywords of ``schema`` that xgrammar 0.2.8 accepts but does not enforce (so the output
    could break the schema), as vLLM lists them; empty when the schema is fully enforced."""
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        kind = node.get("type")
        types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
        if types & {"integer", "number"} and "multipleOf" in node:
            found.add("multipleOf")
        if "array" in types:
            found.update(k for k in ("uniqueItems", "contains", "minContains", "maxContains") if k in node)
        if "string" in types:
            if "format" in node and node["format"] not in _FORMATS:
                found.add(f"format {node['format']!r}")
            if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
                found.add("a pattern or format with minLength/maxLength")
        # accepted and ignored (the output may break them); patternProperties also lets a key
        # repeat ({"x": 1, "x": 2})
        found.update(k for k in _IGNORED if k in node)
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.add("allOf with several branches")
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if node.get("additionalProperties") is False and isinstance(node.get("required"), list):
            missing = [name for name in node["required"] if name not in properties]
            if missing:  # no object satisfies it
                found.add(f"required {', '.join(map(repr, missing))} not allowed by additionalProperties: false")
        for value in node.values():
            visit(value)

    visit(schema)
    return sorted(found)


def _first_line(error: Exception) -> str:
    # xgrammar prefixes its messages with a timestamp and a source location
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
