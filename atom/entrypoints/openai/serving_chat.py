"""``POST /v1/chat/completions``: the messages go through the model's chat template; ``n``
samples, ``logprobs``/``top_logprobs``, streaming with a role chunk per choice first."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from atom.engine.output_processor import RequestOutput
from atom.engine.outputs import TokenLogprobs
from atom.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatResponseMessage,
    DeltaMessage,
    random_id,
)
from atom.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing, Prompt, prepend, sse


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest):
        request_id = random_id("chatcmpl")
        return await self.serve(request_id, self._create(request, request_id))

    async def _create(self, request: ChatCompletionRequest, request_id: str):
        self.check_model(request.model)
        self.check_alive()
        if not request.messages:
            raise OpenAIError("messages must be a non-empty list", param="messages")
        prompt = await self.engine.apply_chat_template(
            [{"role": m.role, "content": m.text()} for m in request.messages],
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs)
        max_tokens = self.max_tokens(request.requested_max_tokens, len(prompt.token_ids), "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs=logprobs)
        outputs = self.generate(request_id, [prompt], [params], request.n)
        if request.stream:
            first = await self.first_output(outputs)
            chunks = self._stream(request, request_id, prompt, first, outputs)
            return StreamingResponse(self.stream_errors(request_id, chunks, outputs), media_type="text/event-stream")
        finals = await self.collect(outputs, request.n)
        choices = [
            ChatCompletionResponseChoice(
                index=i, message=ChatResponseMessage(content=out.text),
                logprobs=self.logprobs(out.token_ids, out.logprobs) if request.logprobs else None,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
            )
            for i, out in enumerate(finals)
        ]
        usage = self.usage([len(prompt.token_ids)], finals)
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(response.model_dump())

    async def _stream(self, request: ChatCompletionRequest, request_id: str, prompt: Prompt,
                      first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]):
        created = int(time.time())
        finals: list[RequestOutput | None] = [None] * request.n

        def chunk(choices, usage=None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                    choices=choices, usage=usage))

        for i in range(request.n):
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])

        outputs = prepend(first, rest)
        async for i, out in outputs:
            if not out.new_token_ids and not out.finished:
                continue
            logprobs = self.logprobs(out.new_token_ids, out.new_logprobs) if request.logprobs else None
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=out.delta_text),
                                                    logprobs=logprobs, finish_reason=out.finish_reason,
                                                    stop_reason=out.stop_reason)])
            if out.finished:
                finals[i] = out
        if request.include_usage_in_stream:
            yield chunk([], usage=self.usage([len(prompt.token_ids)], finals))

    def logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> ChatCompletionLogProbs:
        content = []
        for token_id, lp in zip(token_ids, logprobs or []):
            top = [self._entry(t, v) for t, v in lp.top]
            content.append(ChatLogProbsContent(**self._entry(token_id, lp.logprob).model_dump(), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    def _entry(self, token_id: int, logprob: float) -> ChatLogProb:
        token = self.token_str(token_id)
        return ChatLogProb(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))
