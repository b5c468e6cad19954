"""``POST /v1/chat/completions``: the messages go through the model's chat template; ``n``
samples, ``logprobs``/``top_logprobs``, streaming with a role chunk per choice first; tools,
structured output and reasoning as vLLM serves them (``chat_output``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from atom.engine.output_processor import RequestOutput
from atom.engine.outputs import TokenLogprobs
from atom.entrypoints.openai.chat_output import ChoiceOutput
from atom.entrypoints.openai.parsed_output import DeltaMessage as ParsedDelta
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
from atom.entrypoints.openai.structured_request import ToolPlan, structured_outputs, tool_plan
from atom.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, response_role: str = "assistant",
                 exclude_tools_when_tool_choice_none: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.response_role = response_role  # --response-role
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    async def create_chat_completion(self, request: ChatCompletionRequest):
        request_id = random_id("chatcmpl")
        return await self.serve(request_id, self._create(request, request_id))

    async def _create(self, request: ChatCompletionRequest, request_id: str):
        self.check_model(request.model)
        self.check_alive()
        plan, prompt, params = await self.prepare(request)
        outputs = self.generate(request_id, [prompt], [params], request.n)
        if request.stream:
            first = await self.first_output(outputs)
            chunks = self._stream(request, request_id, prompt, plan, first, outputs)
            return StreamingResponse(self.stream_errors(request_id, chunks, outputs), media_type="text/event-stream")
        finals = await self.collect(outputs, request.n)
        role, echoed = self.request_role(request), self.echoed(request)
        choices = []
        for i, out in enumerate(finals):
            fields, finish_reason = self.choice_output(request, plan).message(out.text, out.finish_reason)
            if echoed:
                fields["content"] = echoed + (fields["content"] or "")
            choices.append(ChatCompletionResponseChoice(
                index=i, message=ChatResponseMessage(role=role, **fields),
                logprobs=self.logprobs(out.token_ids, out.logprobs, self.tokens_as_ids(request))
                if request.logprobs else None,
                finish_reason=finish_reason, stop_reason=out.stop_reason,
                token_ids=out.token_ids if request.return_token_ids else None,
            ))
        usage = self.usage([len(prompt.token_ids)], finals)
        prompt_logprobs = (self.prompt_logprobs(finals[0].prompt_logprobs, request.prompt_logprobs)
                           if request.prompt_logprobs is not None else None)  # fmt: skip
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage,
                                          prompt_token_ids=prompt.token_ids if request.return_token_ids else None,
                                          prompt_logprobs=prompt_logprobs)
        return JSONResponse(response.model_dump())

    async def prepare(self, request: ChatCompletionRequest) -> tuple[ToolPlan, Prompt, SamplingParams]:
        """The request's checks, its tools' plan, the prompt through the chat template and its sampling
        parameters (also the Responses API's, ``serving_responses``)."""
        if not request.messages:
            raise OpenAIError("messages must be a non-empty list", param="messages")
        plan = tool_plan(request, self.tool_call_parser, self.enable_auto_tool_choice)
        structured = structured_outputs(request)
        if plan.forced and structured is not None:
            raise OpenAIError(f"tool_choice {plan.choice!r} constrains the output already: drop the structured "
                              "output fields (response_format, structured_outputs, guided_*)", param="tool_choice")
        # tool_choice "none" still shows the model its tools, as vLLM (unless the flag)
        hidden = plan.choice == "none" and self.exclude_tools_when_tool_choice_none
        tools = None if hidden else plan.tools
        prompt = await self.render_chat(request, tools, truncate=request.truncate_prompt_tokens)
        # left out: what the context leaves (or the model's max_new_tokens), as vLLM's chat
        max_tokens = self.max_tokens(request.requested_max_tokens, len(prompt.token_ids), "messages", default=None)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs=logprobs, prompt_logprobs=request.prompt_logprobs,
                                      structured=plan.constraint or structured)
        return plan, prompt, params

    def request_role(self, request: ChatCompletionRequest) -> str:
        """The role of the response's messages: --response-role, or the last message's when no new
        turn is started (vLLM's get_chat_request_role)."""
        return self.response_role if request.add_generation_prompt else request.messages[-1].role

    def echoed(self, request: ChatCompletionRequest) -> str:
        """With echo: the last message's content, if its role is the response's (vLLM's)."""
        last = request.messages[-1]
        return last.text() if request.echo and last.role == self.request_role(request) else ""

    def choice_output(self, request: ChatCompletionRequest, plan: ToolPlan) -> ChoiceOutput:
        thinking = (request.chat_template_kwargs or {}).get("enable_thinking", True)
        return ChoiceOutput(plan, self.reasoning_parser, self.tool_call_parser, enable_thinking=bool(thinking))

    async def _stream(self, request: ChatCompletionRequest, request_id: str, prompt: Prompt, plan: ToolPlan,
                      first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]):
        created = int(time.time())
        finals: list[RequestOutput | None] = [None] * request.n
        parsers = [self.choice_output(request, plan) for _ in range(request.n)]
        plain = not plan.forced and not plan.parse_output and self.reasoning_parser is None

        def chunk(choices, usage=None, prompt_token_ids=None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                    choices=choices, usage=usage, prompt_token_ids=prompt_token_ids))

        role, echoed, as_ids = self.request_role(request), self.echoed(request), self.tokens_as_ids(request)
        for i in range(request.n):
            first_ids = prompt.token_ids if request.return_token_ids and i == 0 else None
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role=role, content=""))],
                        prompt_token_ids=first_ids)
        if echoed:  # echo: the last message's content comes first, as vLLM sends it
            for i in range(request.n):
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=echoed))])
        # return_token_ids: each choice's token ids not yet sent (a chunk held back by a parser sends none)
        unsent: list[list[int]] = [[] for _ in range(request.n)]

        def token_ids(i: int) -> list[int] | None:
            if not request.return_token_ids:
                return None
            ids, unsent[i] = unsent[i], []
            return ids

        outputs = prepend(first, rest)
        async for i, out in outputs:
            if not out.new_token_ids and not out.finished:
                continue
            unsent[i] += out.new_token_ids
            logprobs = self.logprobs(out.new_token_ids, out.new_logprobs, as_ids) if request.logprobs else None
            if plain:  # no parser: every step's text as it comes (maybe empty: a held-back stop string)
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=out.delta_text),
                                                        logprobs=logprobs, finish_reason=out.finish_reason,
                                                        stop_reason=out.stop_reason, token_ids=token_ids(i))])
                finals[i] = out if out.finished else finals[i]
                continue
            delta = parsers[i].delta(out.delta_text) if out.delta_text else None
            finish_reason = out.finish_reason
            if out.finished:
                finals[i] = out
                tail, finish_reason = parsers[i].finish(out.finish_reason)
                delta = _merge_deltas(delta, tail)
            if delta is None and logprobs is None and not out.finished:
                continue  # a partial tag held back: nothing to send yet
            fields = delta.to_dict() if delta is not None else {}
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(**fields), logprobs=logprobs,
                                                    finish_reason=finish_reason, stop_reason=out.stop_reason,
                                                    token_ids=token_ids(i))])
        if request.include_usage_in_stream:
            yield chunk([], usage=self.usage([len(prompt.token_ids)], finals))

    def logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
                 as_ids: bool = False) -> ChatCompletionLogProbs:
        """``as_ids``: tokens as "token_id:{id}"; the chosen token's bytes stay its text's, the
        alternatives' are the shown string's (as vLLM's)."""
        content = []
        for token_id, lp in zip(token_ids, logprobs or []):
            top = [self._entry(t, v, as_ids) for t, v in lp.top]
            text_bytes = list(self.token_str(token_id).encode("utf-8"))
            content.append(ChatLogProbsContent(token=self.logprob_token(token_id, as_ids), logprob=lp.logprob,
                                               bytes=text_bytes, top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    def _entry(self, token_id: int, logprob: float, as_ids: bool) -> ChatLogProb:
        token = self.logprob_token(token_id, as_ids)
        return ChatLogProb(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def _merge_deltas(a, b):
    if a is None or b is None:
        return a or b
    return ParsedDelta(content=((a.content or "") + (b.content or "")) or None,
                       reasoning_content=((a.reasoning_content or "") + (b.reasoning_content or "")) or None,
                       tool_calls=a.tool_calls + b.tool_calls)
