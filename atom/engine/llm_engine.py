"""``LLMEngine``: the offline API (serving guide section 2), driving an in-process core."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from atom.engine.arg_utils import (  # noqa: F401 - load_tokenizer re-exported
    EngineArgs,
    eos_token_ids,
    load_tokenizer,
    sampling_defaults,
)
from atom.engine.engine_core import EngineCore
from atom.engine.input_processor import InputProcessor, ProcessedPrompt
from atom.engine.output_processor import RequestOutput, RequestState
from atom.engine.outputs import EngineCoreRequest
from atom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, model: str | None = None, **kwargs):
        self.args = EngineArgs(model=model, **kwargs)
        self.config = self.args.create_engine_config()
        mc = self.config.model_config
        if self.config.device.type != "cuda" and not self.args.enforce_eager:
            logger.info("CUDA graphs and torch.compile (level %d) apply to CUDA devices; running eagerly on %s",
                        self.config.compilation_config.level, self.config.device)
        self.tokenizer = None if self.args.skip_tokenizer_init else load_tokenizer(mc.tokenizer, mc.trust_remote_code)
        self.eos_token_ids = eos_token_ids(mc.model, mc.hf_config, self.tokenizer)
        self.default_sampling_params = sampling_defaults(mc)
        self.core = _make_core(self.config)
        self.input_processor = InputProcessor(self.tokenizer, mc.hf_config.vocab_size, mc.max_model_len,
                                              self.core.info().max_seq_len, mc.max_logprobs)
        self.states: dict[str, RequestState] = {}
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(**dataclasses.asdict(args))

    # requests
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; ValueError naming what is wrong with it."""
        processed = self.input_processor.tokenize(prompt)
        return processed.text, processed.token_ids

    def add_request(
        self,
        prompt_or_tokens_list: Prompt | Sequence[Prompt],
        sampling_params_list: SamplingParams | Sequence[SamplingParams] | None = None,
        stream_callback: Callable[[RequestOutput], None] | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Queue prompts (strings or token-id lists, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}`` dicts); returns their request ids. Every prompt is
        validated before any is queued, so a bad one adds nothing. A prompt with ``n`` > 1
        samples is ``n`` requests, ``f"{i}_{id}"`` (vLLM's child request ids), all returned."""
        tokenized = [self.input_processor.tokenize(p) for p in _as_prompt_list(prompt_or_tokens_list)]
        groups = self._add(tokenized, sampling_params_list, stream_callback, request_ids)
        return [rid for group in groups for rid in group]

    def _add(
        self,
        prompts: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        stream_callback: Callable[[RequestOutput], None] | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[list[str]]:
        """Queue checked prompts; returns the request ids of each prompt's samples."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = list(request_ids) if request_ids is not None else [str(next(self._ids)) for _ in prompts]
        for sp in params:
            self.input_processor.process_params(sp)
        params = [self.input_processor.resolve_max_tokens(sp, len(p.token_ids)) for sp, p in zip(params, prompts)]
        groups = []
        for rid, prompt, sp in zip(ids, prompts, params):
            # vLLM's parallel sampling: each sample is a request of its own (its own seed if seeded)
            group = [rid] if sp.n == 1 else [f"{i}_{rid}" for i in range(sp.n)]
            for i, sample_id in enumerate(group):
                sample = sp.sample(i)
                state = RequestState(sample_id, prompt.text, prompt.token_ids, sample, self.tokenizer, stream_callback)
                # the replica that runs it (0 without -dp), for RequestOutput.engine_index
                state.engine_index = self.core.add_request(
                    EngineCoreRequest(sample_id, prompt.token_ids, sample, self.eos_token_ids))
                self.states[sample_id] = state
            groups.append(group)
        return groups

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling params gets: the model's recommended defaults
        (``--generation-config``), vLLM's ``LLM.get_default_sampling_params``."""
        return SamplingParams(**self.default_sampling_params)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(ids)
        for rid in ids:
            self.states.pop(rid, None)

    def is_finished(self) -> bool:
        return not self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; stream new tokens to callbacks and return finished requests.
        A request whose output processing or stream callback raises is finished with
        ``finish_reason="error"`` (its blocks freed); the others carry on."""
        finished = []
        for out in self.core.step():
            state = self.states.get(out.request_id)
            if state is None:
                continue
            try:
                result = self._process(state, out)
            except Exception:
                logger.exception("request %s failed; finishing it with an error", out.request_id)
                self.core.abort_requests([out.request_id])
                result = state.fail()
            if result is not None and result.finished:
                self.states.pop(out.request_id, None)
                finished.append(result)
        return finished

    def _process(self, state: RequestState, out) -> RequestOutput | None:
        result, stopped = state.update(out, want_output=state.stream_callback is not None)
        if stopped:
            self.core.abort_requests([out.request_id])
        if result is not None and state.stream_callback is not None and (result.new_token_ids or result.finished):
            state.stream_callback(result)
        return result

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict]:
        """One result dict per prompt, in order (see ``_result``)."""
        tokenized = [self.input_processor.tokenize(p) for p in _as_prompt_list(prompts)]
        return self._run(self._add(tokenized, sampling_params), use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[dict]:
        """vLLM's ``LLM.chat``: each conversation (a list of ``{"role", "content"}`` messages;
        ``messages`` is one conversation or a list of them) through the chat template (the
        tokenizer's, or ``chat_template``), then generated as ``generate`` does: one result
        dict per conversation, in order."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools  # rendered by the template, as in the server's chat requests
        prompts = [self.input_processor.apply_chat_template(list(c), add_generation_prompt, continue_final_message,
                                                            kwargs, chat_template=chat_template)
                   for c in conversations]  # fmt: skip
        return self._run(self._add(prompts, sampling_params), use_tqdm)

    def _run(self, groups: list[list[str]], use_tqdm: bool) -> list[dict]:
        """Step until every request of ``groups`` has finished; one result dict per group."""
        ids = [rid for group in groups for rid in group]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while len(results) < len(ids):
                if self.is_finished():
                    raise RuntimeError("engine stopped with unfinished requests")
                for out in self.step():
                    results[out.request_id] = out
                    bar.update(1)
        return [_result([results[rid] for rid in group]) for group in groups]

    # the serving guide's extras
    def start_profile(self) -> None:
        self.core.start_profile()

    def stop_profile(self) -> None:
        self.core.stop_profile()

    def print_mtp_statistics(self) -> None:
        """Print the speculative decoding statistics (the serving guide's MTP statistics):
        draft tokens, accepted tokens, acceptance rate overall and by draft position, mean
        accepted length. Prints that speculative decoding is off when it is."""
        stats = self.core.stats().spec
        print(stats.format() if stats is not None else "MTP Statistics: speculative decoding is off")

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks and data-parallel replicas now (they also stop
        when the engine is garbage-collected or the interpreter exits)."""
        self.core.shutdown()


def _make_core(config):
    """The in-process core, or with ``-dp N`` a client of N engine-core processes."""
    if config.parallel_config.data_parallel_size == 1:
        return EngineCore(config)
    from atom.engine.dp_client import DPEngineCoreClient  # ZMQ: imported only when needed

    return DPEngineCoreClient(config)


def _result(samples: list[RequestOutput]) -> dict:
    """A prompt's result: the serving guide's dict of its first sample, and in ``outputs`` the
    dict of each of its ``n`` samples with its ``index`` (vLLM's ``RequestOutput.outputs``)."""
    outputs = [{"index": i, **out.to_dict()} for i, out in enumerate(samples)]
    return {**samples[0].to_dict(), "outputs": outputs}


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [_unwrap(prompts)]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single token-id prompt
    return [_unwrap(p) for p in prompts]


def _unwrap(prompt):
    """vLLM's prompt dicts, ``{"prompt": text}`` (TextPrompt) and ``{"prompt_token_ids": ids}``
    (TokensPrompt), as the text or the ids; anything else as it is."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) in ({"prompt"}, {"prompt_token_ids"}):
        return next(iter(prompt.values()))
    raise ValueError(f"a prompt dict takes one key, 'prompt' (text) or 'prompt_token_ids'; got {sorted(prompt)}")
