"""The structured-output manager: requests wait for their grammar, the batch bitmask follows
the scheduled order, reasoning stays free until ``</think>``, a bad spec is an error."""

import json

import pytest
import torch

from atom.ops.penalties import unpack_bitmask
from atom.structured_output import GrammarSpec
from atom.structured_output.manager import StructuredOutputManager


def greedy(manager, request_ids, max_steps=60):
    """Random logits under the batch mask, argmax, fed back: the runner's loop in small."""
    outputs = {rid: [] for rid in request_ids}
    gen = torch.Generator().manual_seed(0)
    for _ in range(max_steps):
        live = [rid for rid in request_ids if not manager.is_terminated(rid)]
        if not live:
            break
        logits = torch.randn(len(live), manager.compiler.vocab_size, generator=gen)
        mask = manager.grammar_bitmask(live)
        if mask is not None:
            logits.masked_fill_(~unpack_bitmask(mask, logits.shape[1]), float("-inf"))
        for rid, token in zip(live, logits.argmax(-1).tolist()):
            assert manager.accept_tokens(rid, [token])
            outputs[rid].append(token)
    return outputs


def test_batch_follows_the_scheduled_order(compiler, tokenizer):
    manager = StructuredOutputManager(compiler, max_num_seqs=4)
    manager.add_request("json", GrammarSpec.from_options(json_schema={"enum": ["up", "down"]}))
    manager.add_request("digits", GrammarSpec.from_options(regex="[0-9]{3}"))
    compiler.submit(GrammarSpec.from_options(regex="[0-9]{3}")).result()
    compiler.submit(GrammarSpec.from_options(json_schema={"enum": ["up", "down"]})).result()
    assert manager.is_ready("json") and manager.is_ready("digits")
    assert manager.grammar_bitmask([None, "free"]) is None  # nothing constrained: nothing to apply
    mask = manager.grammar_bitmask(["digits", None, "json"])
    assert mask.shape[0] == 3 and unpack_bitmask(mask[1:2], compiler.vocab_size).all()
    outputs = greedy(manager, ["json", "digits"])
    eos = tokenizer.eos_token_id
    assert outputs["json"][-1] == eos and json.loads(tokenizer.decode(outputs["json"][:-1])) in ("up", "down")
    assert outputs["digits"][-1] == eos and tokenizer.decode(outputs["digits"][:-1]).isdigit()


def test_reasoning_is_free_until_its_end_token(compiler, tokenizer):
    think_end = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # any single token stands in for </think>
    manager = StructuredOutputManager(compiler, max_num_seqs=1, reasoning_end_token_id=think_end)
    spec = GrammarSpec.from_options(choice=["yes", "no"])
    manager.add_request("r", spec, reasoning=True)
    compiler.submit(spec).result()
    free_text = tokenizer.encode("Let me think", add_special_tokens=False)
    assert manager.grammar_bitmask(["r"]) is None
    assert manager.accept_tokens("r", free_text)  # not a choice, but still reasoning
    assert manager.grammar_bitmask(["r"]) is None
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert manager.accept_tokens("r", [think_end, *yes[:1]])  # the grammar starts after the end token
    assert manager.grammar_bitmask(["r"]) is not None
    assert not manager.accept_tokens("r", tokenizer.encode("maybe", add_special_tokens=False))


def test_a_bad_grammar_is_an_error_not_a_hang(compiler):
    manager = StructuredOutputManager(compiler, max_num_seqs=1)
    manager.add_request("bad", GrammarSpec("regex", "(unclosed"))
    with pytest.raises(ValueError):
        compiler.submit(GrammarSpec("regex", "(unclosed")).result()
    assert manager.is_ready("bad")
    assert "Invalid regex" in manager.error("bad")
    manager.remove_request("bad")
    assert manager.grammar_bitmask(["bad"]) is None
