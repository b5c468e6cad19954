"""Structured output on the default model's tokenizer: any token sequence the mask allows
(random logits, then the argmax under the mask) ends as output that parses and validates."""

import json
import re
import threading

import jsonschema_rs
import pytest
import torch

from atom.ops.penalties import unpack_bitmask
from atom.structured_output import GrammarSpec, GrammarState, bitmask
from atom.testing.json_schemas import SCHEMAS

MAX_TOKENS = 200


def generate(compiler, tokenizer, spec: GrammarSpec, seed: int, rows: int = 1) -> list[str]:
    """Random logits masked by the grammar, argmax, for ``rows`` requests batched together."""
    states = [GrammarState(compiler.compile(spec)) for _ in range(rows)]
    outputs: list[list[int]] = [[] for _ in range(rows)]
    mask = bitmask.allocate(rows + 1, compiler.vocab_size)  # one spare row: only the first rows are applied
    gen = torch.Generator().manual_seed(seed)
    for _ in range(MAX_TOKENS):
        active = [s if not s.is_terminated else None for s in states]
        if not bitmask.fill(mask, active):
            break
        logits = torch.randn(rows, compiler.vocab_size, generator=gen)
        bitmask.apply(logits, mask)
        for row, token in enumerate(logits.argmax(dim=-1).tolist()):
            if active[row] is not None:
                assert active[row].accept([token])
                if not active[row].is_terminated:
                    outputs[row].append(token)
    assert all(s.is_terminated for s in states), "the grammar did not finish within MAX_TOKENS"
    return [tokenizer.decode(out) for out in outputs]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_output_parses_and_validates(compiler, tokenizer, index):
    schema = SCHEMAS[index]
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    for text in generate(compiler, tokenizer, GrammarSpec.from_options(json_schema=schema), seed=index, rows=3):
        validator.validate(json.loads(text))


def test_json_object_regex_choice_and_grammar(compiler, tokenizer):
    # a json_object's free-form content needs no finite grammar, so pass a bounded schema through
    # the same path and check json_object compiles and starts an object
    state = GrammarState(compiler.compile(GrammarSpec.from_response_format({"type": "json_object"})))
    mask = bitmask.allocate(1, compiler.vocab_size)
    bitmask.fill(mask, [state])
    allowed = unpack_bitmask(mask, compiler.vocab_size)[0].nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)

    for seed in range(3):
        [text] = generate(compiler, tokenizer, GrammarSpec.from_options(regex=r"(yes|no), [0-9]{2} (cats|dogs)"), seed)
        assert re.fullmatch(r"(yes|no), [0-9]{2} (cats|dogs)", text), text
        choices = ['say "hi"', "emoji 🙂", "back\\slash"]
        [text] = generate(compiler, tokenizer, GrammarSpec.from_options(choice=choices), seed)
        assert text in choices
        ebnf = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" [0-9]'
        [text] = generate(compiler, tokenizer, GrammarSpec.from_options(grammar=ebnf), seed)
        assert re.fullmatch(r"\([0-9](\+[0-9])?\)", text), text


def test_response_format_json_schema_maps_to_the_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert spec == GrammarSpec.from_options(json_schema=json.dumps(schema, sort_keys=True))
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    assert GrammarSpec.from_response_format(None) is None
    with pytest.raises(ValueError, match="json_schema.schema"):
        GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="response_format type"):
        GrammarSpec.from_response_format({"type": "yaml"})


def test_bad_specs_are_clear_errors(compiler):
    with pytest.raises(ValueError, match="Only one kind"):
        GrammarSpec.from_options(json_schema={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="non-empty list"):
        GrammarSpec.from_options(choice=[])
    for spec in [
        GrammarSpec("json", '{"type": "nope"}'),
        GrammarSpec("regex", "(a"),
        GrammarSpec("grammar", "root ::="),
    ]:
        with pytest.raises(ValueError, match=f"Invalid {spec.kind}") as error:
            spec.validate()
        assert "\n" not in str(error.value)
        with pytest.raises(ValueError):  # and the future of a bad spec fails the same way
            compiler.submit(spec).result()


def test_compiled_off_the_calling_thread_and_cached(compiler):
    spec = GrammarSpec.from_options(regex="[a-c]{3}")
    caller = threading.get_ident()
    future = compiler.submit(spec)
    assert future.result() is not None
    assert compiler.submit(spec) is future  # cached by (kind, spec)
    assert compiler.submit(GrammarSpec.from_options(regex="[a-c]{4}")) is not future
    seen = []
    compiler.submit(GrammarSpec.from_options(regex="[d-f]{2}")).add_done_callback(
        lambda f: seen.append(threading.get_ident())
    )
    compiler.submit(GrammarSpec.from_options(regex="[d-f]{2}")).result()
    assert seen and seen[0] != caller


def test_bitmask_applies_the_same_on_every_path(compiler):
    state = GrammarState(compiler.compile(GrammarSpec.from_options(choice=["alpha", "beta"])))
    mask = bitmask.allocate(2, compiler.vocab_size)
    assert bitmask.fill(mask, [state, None])
    logits = torch.randn(2, compiler.vocab_size)
    fast = logits.clone()
    bitmask.apply(fast, mask)  # xgrammar's CPU kernel
    half = logits.to(torch.bfloat16)
    bitmask.apply(half, mask)  # the torch fallback
    expected = logits.masked_fill(~unpack_bitmask(mask, compiler.vocab_size), float("-inf"))
    assert torch.equal(fast, expected)
    assert torch.equal(half.isinf(), expected.isinf())
    assert not fast[1].isinf().any()  # the unconstrained row
    assert 0 < (~fast[0].isinf()).sum() < 10


def test_rejected_token_leaves_the_state_unchanged(compiler, tokenizer):
    state = GrammarState(compiler.compile(GrammarSpec.from_options(regex="ab")))
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    assert not state.accept([b])
    assert state.accept([a]) and state.accept([b]) and not state.is_terminated
    assert state.accept([tokenizer.eos_token_id]) and state.is_terminated


def test_no_raw_control_characters_inside_json_strings(compiler, tokenizer):
    # JSON wants control characters escaped; xgrammar alone lets them into length-bounded strings
    control = [t for t in range(len(tokenizer)) if any(ord(ch) < 0x20 for ch in tokenizer.decode([t]))]
    assert control
    for schema in [{"type": "string", "maxLength": 5}, {"type": "string"}]:
        state = GrammarState(compiler.compile(GrammarSpec.from_options(json_schema=schema)))
        assert state.accept(tokenizer.encode('"a', add_special_tokens=False))
        mask = bitmask.allocate(1, compiler.vocab_size)
        bitmask.fill(mask, [state])
        allowed = unpack_bitmask(mask, compiler.vocab_size)[0]
        assert not allowed[control].any(), [tokenizer.decode([t]) for t in control if allowed[t]]


@pytest.mark.parametrize(
    "options, reason",
    [
        (dict(regex=r"[^\s\S]"), "no output satisfies it"),
        # xgrammar 0.2.8 compiles it and atom's emptiness check refuses it; from 0.2.9 xgrammar
        # itself refuses the self-reference ("Circular $ref chain ..."): either way, at validation
        (dict(json_schema={"$ref": "#"}), r"no output satisfies it|Circular \$ref"),
    ],
)
def test_constraints_no_output_satisfies_are_rejected(compiler, options, reason):
    """Found by an adversarial server test: these compiled, then failed the request at its first
    token in the engine (a 500)."""
    spec = GrammarSpec.from_options(**options)
    kind = "regex" if "regex" in options else "json"
    with pytest.raises(ValueError, match=rf"^Invalid {kind} for structured output: ({reason})"):
        spec.validate()
    with pytest.raises(ValueError, match=rf"^Invalid {kind} for structured output: ({reason})"):  # the engine too
        compiler.compile(spec)
    GrammarSpec.from_options(regex=r"a|[^\s\S]").validate()  # one way out is enough


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "integer", "multipleOf": 3}, "multipleOf"),
        (
            {
                "type": "object",
                "properties": {"t": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
            },
            "uniqueItems",
        ),
        ({"type": "string", "format": "credit-card"}, "format 'credit-card'"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "minLength/maxLength"),
        ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, "allOf"),
        # found by an adversarial server test: accepted, then ignored by the grammar
        ({"type": "string", "not": {"type": "string"}}, "not"),
        ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, "patternProperties"),
        ({"type": "object", "propertyNames": {"maxLength": 1}}, "propertyNames"),
        ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}, "required 'a'"),
    ],
)
def test_schemas_the_grammar_cannot_enforce_are_rejected(compiler, schema, keyword):
    spec = GrammarSpec.from_options(json_schema=schema)
    with pytest.raises(ValueError, match="cannot enforce") as error:
        spec.validate()
    assert keyword in str(error.value)
    with pytest.raises(ValueError, match="cannot enforce"):  # the engine side refuses it too
        compiler.compile(spec)
