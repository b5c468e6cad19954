"""``POST /v1/completions``: text or token-id prompts, ``n`` samples each, ``echo`` and
legacy ``logprobs`` (with ``echo``, the prompt's logprobs too, as lm-eval's loglikelihood
tasks need)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from atom.engine.output_processor import RequestOutput
from atom.engine.outputs import TokenLogprobs
from atom.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    random_id,
)
from atom.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing, Prompt, prepend, sse
from atom.entrypoints.openai.structured_request import structured_outputs


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest):
        request_id = random_id("cmpl")
        return await self.serve(request_id, self._create(request, request_id))

    async def _create(self, request: CompletionRequest, request_id: str):
        self.check_model(request.model)
        self.check_alive()
        if request.max_tokens == 0 and not request.echo:
            raise OpenAIError("max_tokens must be at least 1 (0 only with echo=true: the prompt without a completion)",
                              param="max_tokens")
        prompts = [await self.engine.tokenize(p, truncate=request.truncate_prompt_tokens) for p in request.prompts()]
        # echo shows the prompt's text: decode token-id prompts once, off the event loop
        echoed = [p.text if p.text is not None or not request.echo else await self.engine.detokenize(p.token_ids)
                  for p in prompts]
        # the prompt's logprobs: prompt_logprobs' top N, and echo's with logprobs (computed once, the larger N)
        wanted = [n for n in (request.prompt_logprobs, request.logprobs if request.echo else None) if n is not None]
        structured = structured_outputs(request)
        params = [
            self.sampling_params(request, self.max_tokens(1 if request.echo_only else request.max_tokens,
                                                          len(p.token_ids), "prompt"),
                                 logprobs=request.logprobs,
                                 prompt_logprobs=max(wanted) if wanted else None,
                                 structured=structured)
            for p in prompts
        ]
        outputs = self.generate(request_id, prompts, params, request.n)
        if request.stream:
            first = await self.first_output(outputs)
            chunks = self._stream(request, request_id, prompts, echoed, first, outputs)
            return StreamingResponse(self.stream_errors(request_id, chunks, outputs), media_type="text/event-stream")
        finals = await self.collect(outputs, len(prompts) * request.n)
        choices = [self._choice(request, i, prompts[i // request.n], echoed[i // request.n], out)
                   for i, out in enumerate(finals)]
        usage = self.usage([len(p.token_ids) for p in prompts], finals, request.echo_only)
        response = CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(response.model_dump())

    def _choice(self, request: CompletionRequest, index: int, prompt: Prompt, echoed: str | None,
                out: RequestOutput):
        text, logprobs = out.text, None
        entries = list(zip(out.token_ids, out.logprobs or []))
        if request.echo_only:  # the generated token is left out
            text, entries = "", []
        if request.echo:
            text = echoed + text
            if request.logprobs is not None:
                entries = list(zip(prompt.token_ids, out.prompt_logprobs or [])) + entries
        if request.logprobs is not None:
            logprobs = self.logprobs(entries, 0, self.tokens_as_ids(request), request.logprobs)
        ids = dict(prompt_token_ids=prompt.token_ids, token_ids=out.token_ids) if request.return_token_ids else {}
        prompt_logprobs = (self.prompt_logprobs(out.prompt_logprobs, request.prompt_logprobs)
                           if request.prompt_logprobs is not None else None)  # fmt: skip
        return CompletionResponseChoice(index=index, text=text, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                        finish_reason=out.finish_reason, stop_reason=out.stop_reason, **ids)

    async def _stream(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                      echoed: list[str | None], first: tuple[int, RequestOutput],
                      rest: AsyncIterator[tuple[int, RequestOutput]]):
        created = int(time.time())
        num_choices = len(prompts) * request.n
        offsets = [0] * num_choices  # characters streamed per choice, for logprobs' text_offset
        started = [False] * num_choices
        finals: list[RequestOutput | None] = [None] * num_choices

        outputs = prepend(first, rest)
        async for i, out in outputs:
            if not out.new_token_ids and not out.finished:
                continue  # e.g. prompt logprobs of a prefill chunk: nothing to show yet
            prompt = prompts[i // request.n]
            text, entries = out.delta_text, list(zip(out.new_token_ids, out.new_logprobs))
            if request.echo_only:  # the generated token is left out
                text, entries = "", []
            ids = dict(token_ids=out.new_token_ids) if request.return_token_ids else {}
            if not started[i]:
                started[i] = True
                if request.return_token_ids:
                    ids["prompt_token_ids"] = prompt.token_ids
                if request.echo:
                    text = echoed[i // request.n] + text
                    if request.logprobs is not None:
                        entries = list(zip(prompt.token_ids, out.prompt_logprobs or [])) + entries
            logprobs = (self.logprobs(entries, offsets[i], self.tokens_as_ids(request), request.logprobs)
                        if request.logprobs is not None else None)
            offsets[i] += len(text)
            choice = CompletionResponseChoice(index=i, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                              stop_reason=out.stop_reason, **ids)
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                               choices=[choice]))
            if out.finished:
                finals[i] = out
        if request.include_usage_in_stream:
            usage = self.usage([len(p.token_ids) for p in prompts], finals, request.echo_only)
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                               usage=usage))

    def logprobs(self, entries: list[tuple[int, TokenLogprobs | None]], offset: int,
                 as_ids: bool, top_n: int) -> CompletionLogProbs:
        """Legacy completion logprobs; ``None`` entries (the first prompt token) have none.
        ``as_ids``: tokens as "token_id:{id}" (offsets count those strings, as vLLM's); ``top_n``
        alternatives each (the prompt's may have been computed with more, for prompt_logprobs)."""
        result = CompletionLogProbs()
        for token_id, lp in entries:
            token = self.logprob_token(token_id, as_ids)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if lp is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(lp.logprob)
            top = {self.logprob_token(t, as_ids): v for t, v in lp.top[:top_n]}
            top.setdefault(token, lp.logprob)  # the chosen token is always listed, as vLLM does
            result.top_logprobs.append(top)
        return result
