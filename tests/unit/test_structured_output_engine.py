"""Structured output through ``LLMEngine`` on a tiny random checkpoint: whatever the model
prefers, the grammar's mask (applied in the sampler, batched) makes every output parse and
validate; the same with async scheduling, n>1 seeds, preemption, and plain requests beside."""

from __future__ import annotations

import json
import re

import jsonschema_rs
import pytest

from atom import LLMEngine, SamplingParams
from atom.sampling_params import StructuredOutputsParams
from atom.testing.json_schemas import SCHEMAS

MAX_TOKENS = 300


def make_engine(path: str, **kwargs) -> LLMEngine:
    args = dict(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=32 << 20)
    return LLMEngine(path, **(args | kwargs))


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def engine(model) -> LLMEngine:
    return make_engine(model)


def constrained(i: int, **fields) -> SamplingParams:
    """Greedy for even ``i``, sampled with seed ``i`` for odd."""
    return SamplingParams(
        temperature=0.0 if i % 2 == 0 else 0.9,
        seed=i,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(**fields),
    )


def check_json(output: dict, schema: dict) -> None:
    assert output["finish_reason"] == "stop", output
    jsonschema_rs.validator_for(schema, validate_formats=True).validate(json.loads(output["text"]))


def test_every_schema_greedy_and_sampled(engine):
    prompts = [f"Reply in JSON, case {i}." for i in range(len(SCHEMAS))]
    params = [constrained(i, json=schema, disable_any_whitespace=i % 3 == 0) for i, schema in enumerate(SCHEMAS)]
    for i, out in enumerate(engine.generate(prompts, params, use_tqdm=False)):
        check_json(out, SCHEMAS[i])


def test_regex_choice_grammar_and_json_object_beside_plain_requests(engine):
    close = engine.tokenizer.convert_tokens_to_ids("}")
    params = [
        constrained(0, regex=r"[a-z]{3}-[0-9]{2}"),
        constrained(1, choice=["yes", "no", "maybe"]),
        constrained(2, grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
        # a random model writes keys forever: logit_bias (applied in the same pass) closes the object
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            logit_bias={close: 30},
            structured_outputs=StructuredOutputsParams(json_object=True),
        ),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),  # unconstrained row in the same batch
    ]
    outs = engine.generate(["a", "b", "c", "d", "e"], params, use_tqdm=False)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", outs[0]["text"])
    assert outs[1]["text"] in ("yes", "no", "maybe")
    assert re.fullmatch(r"\(\d+(\+\d+)*\)", outs[2]["text"])
    assert json.loads(outs[3]["text"]) == {}
    plain = engine.generate(["e"], params[4], use_tqdm=False)[0]["text"]
    assert outs[4]["text"] == plain  # the bitmask of the others left this row alone


def test_async_scheduling_and_preemption_give_the_same_valid_outputs(model, engine):
    schemas = [SCHEMAS[i] for i in (1, 2, 4, 5, 6, 13)]  # short outputs
    prompts = [f"J{i}" for i in range(len(schemas))]
    params = [constrained(i, json=s, disable_any_whitespace=True) for i, s in enumerate(schemas)]
    expected = [o["text"] for o in engine.generate(prompts, params, use_tqdm=False)]
    # 4 blocks of 8 tokens: room for any one of them, not all six, so running ones are preempted
    small = make_engine(model, async_scheduling=True, num_gpu_blocks_override=4, block_size=8)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.core.scheduler.num_preemptions > 0
    assert [o["text"] for o in outs] == expected
    for out, schema in zip(outs, schemas):
        check_json(out, schema)


def test_seeded_samples_differ_and_all_validate(engine):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 6}
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=schema)
        )
        for s in range(4)
    ]
    outs = engine.generate(["numbers"] * 4, params, use_tqdm=False)
    for out in outs:
        check_json(out, schema)
    assert len({o["text"] for o in outs}) > 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json": {"type": "integer", "multipleOf": 3}}, "multipleOf"),
        ({"regex": "(unclosed"}, "Invalid regex"),
        ({"grammar": "root ::= undefined_rule"}, "Invalid grammar"),
    ],
)
def test_a_bad_constraint_is_a_value_error_before_anything_runs(engine, fields, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(["x"], constrained(0, **fields))
    assert engine.is_finished()


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
