"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API as vLLM serves it for
text models. A request becomes a chat request (instructions as the system message, input items as
messages, function tools, ``text.format`` as ``response_format``) and runs through the chat endpoint's
machinery; its output (reasoning, text, function calls) comes back as output items, whole or as the
Responses API's stream of events.

As vLLM's, responses are kept for ``previous_response_id`` and ``GET`` only when the server runs with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``store`` is otherwise ignored); atom keeps the latest
``STORE_SIZE`` of them.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from atom.engine.output_processor import RequestOutput
from atom.entrypoints.openai.chat_output import ChoiceOutput
from atom.entrypoints.openai.parsed_output import DeltaMessage
from atom.entrypoints.openai.protocol import ChatCompletionRequest
from atom.entrypoints.openai.responses_protocol import (
    FunctionCallOutput,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningContent,
    ReasoningInputItem,
    ReasoningItem,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    item_id,
)
from atom.entrypoints.openai.serving_chat import OpenAIServingChat
from atom.entrypoints.openai.serving_engine import OpenAIError, Prompt, prepend, to_openai_error

STORE_SIZE = 4096  # responses kept (VLLM_ENABLE_RESPONSES_API_STORE=1), the oldest dropped first


class OpenAIServingResponses(OpenAIServingChat):
    def __init__(self, *args, store: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        # id -> (the response, its conversation as chat messages: input and output)
        self.store: OrderedDict[str, tuple[ResponsesResponse, list[dict]]] | None = OrderedDict() if store else None

    async def create_response(self, request: ResponsesRequest):
        response_id = item_id("resp")
        return await self.serve(response_id, self._create(request, response_id))

    async def retrieve_response(self, response_id: str):
        stored = (self.store or {}).get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored[0].model_dump())

    async def _create(self, request: ResponsesRequest, response_id: str):
        self.check_model(request.model)
        self.check_alive()
        if request.background:
            raise OpenAIError("background responses are not supported by atom", param="background")
        messages = self._history(request.previous_response_id) + input_messages(request)
        chat = chat_request(request, messages)
        try:
            plan, prompt, params = await self.prepare(chat)
        except OpenAIError as e:  # named by the Responses field the client sent
            e.info.param = _PARAMS.get(e.info.param, e.info.param)
            raise
        outputs = self.generate(response_id, [prompt], [params], 1)
        if request.stream:
            first = await self.first_output(outputs)
            events = _Events(self, request, response_id, prompt, messages, self.choice_output(chat, plan))
            return StreamingResponse(events.stream(first, outputs), media_type="text/event-stream")
        [final] = await self.collect(outputs, 1)
        fields, _ = self.choice_output(chat, plan).message(final.text, final.finish_reason)
        items = output_items(fields, self._logprobs(request, final), incomplete=final.finish_reason == "length")
        response = self.response(request, response_id, items, final, prompt)
        self.keep(request, response, messages)
        return JSONResponse(response.model_dump())

    def _history(self, previous_id: str | None) -> list[dict]:
        if previous_id is None:
            return []
        stored = (self.store or {}).get(previous_id)
        if stored is None:
            raise _not_found(previous_id, param="previous_response_id")
        return list(stored[1])

    def _logprobs(self, request: ResponsesRequest, final: RequestOutput) -> list[dict] | None:
        if not request.wants_logprobs:
            return None
        return [c.model_dump() for c in self.logprobs(final.token_ids, final.logprobs).content]

    def delta_logprobs(self, request: ResponsesRequest, out: RequestOutput) -> list[dict]:
        """The logprobs of the tokens new in ``out``, [] unless asked for: a streamed text delta's (OpenAI's
        delta event schema: token, logprob, top_logprobs of token and logprob; no bytes)."""
        if not request.wants_logprobs or not out.new_token_ids:
            return []
        return [{"token": c.token, "logprob": c.logprob,
                 "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in c.top_logprobs]}
                for c in self.logprobs(out.new_token_ids, out.new_logprobs).content]  # fmt: skip

    def response(self, request: ResponsesRequest, response_id: str, items: list, final: RequestOutput | None,
                 prompt: Prompt) -> ResponsesResponse:  # fmt: skip
        """The response object: in progress (``final`` None) or done, with the request's settings."""
        status, incomplete, usage = "in_progress", None, None
        if final is not None:
            status = "incomplete" if final.finish_reason == "length" else "completed"
            incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            reasoning = sum(len(self.tokenizer.encode(c.text, add_special_tokens=False))
                            for i in items if isinstance(i, ReasoningItem) for c in i.content)  # fmt: skip
            usage = ResponseUsage(
                input_tokens=len(prompt.token_ids),
                input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
                output_tokens=len(final.token_ids),
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
                total_tokens=len(prompt.token_ids) + len(final.token_ids),
            )
        tool_choice = request.tool_choice
        return ResponsesResponse(
            id=response_id, status=status, incomplete_details=incomplete, model=self.model_name, output=items,
            usage=usage, instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, store=request.store and self.store is not None,
            temperature=request.temperature, top_p=request.top_p,
            tools=[t.model_dump(exclude_none=True) for t in request.tools],
            tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            parallel_tool_calls=request.parallel_tool_calls,
            text=request.text.model_dump(by_alias=True, exclude_none=True) if request.text else None,
            reasoning=request.reasoning.model_dump() if request.reasoning else None, truncation=request.truncation,
            top_logprobs=request.top_logprobs, metadata=request.metadata, user=request.user,
            service_tier=request.service_tier,
        )  # fmt: skip

    def keep(self, request: ResponsesRequest, response: ResponsesResponse, messages: list[dict]) -> None:
        """Stored (``store`` and the server's store on): the response, and its conversation for a
        later ``previous_response_id``."""
        if self.store is None or not request.store:
            return
        self.store[response.id] = (response, messages + output_messages(response.output))
        while len(self.store) > STORE_SIZE:
            self.store.popitem(last=False)


def _not_found(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", status=404, param=param)


def input_messages(request: ResponsesRequest) -> list[dict]:
    """The instructions and input items as chat messages: a function call joins the assistant turn
    before it, a reasoning item goes with the assistant turn after it, "developer" is "system"."""
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    if isinstance(request.input, str):
        return messages + [{"role": "user", "content": request.input}]
    reasoning = None  # a reasoning item's text, for the assistant turn after it
    for item in request.input:
        if isinstance(item, ReasoningInputItem):
            reasoning = item.text()
            continue
        if isinstance(item, InputMessage):
            message = {"role": "system" if item.role == "developer" else item.role, "content": item.text()}
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            if messages and messages[-1]["role"] == "assistant" and reasoning is None:
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        if message["role"] == "assistant" and reasoning is not None:
            message["reasoning"], reasoning = reasoning, None
        messages.append(message)
    return messages


def output_messages(items: list) -> list[dict]:
    """A response's output items as the assistant turn a later request continues from."""
    turn: dict = {"role": "assistant", "content": None}
    for item in items:
        if isinstance(item, ReasoningItem):
            turn["reasoning"] = "".join(c.text for c in item.content)
        elif isinstance(item, OutputMessage):
            turn["content"] = "".join(c.text for c in item.content)
        elif isinstance(item, FunctionCallOutput):
            turn.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function",
                                                      "function": {"name": item.name, "arguments": item.arguments}})
    return [turn]


def chat_request(request: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request that runs a Responses request; its refusals name the Responses field."""
    fields = dict(
        messages=messages, max_completion_tokens=request.max_output_tokens, temperature=request.temperature,
        top_p=request.top_p, top_k=request.top_k, min_p=request.min_p, seed=request.seed, stop=request.stop,
        stop_token_ids=request.stop_token_ids, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
        logit_bias=request.logit_bias, ignore_eos=request.ignore_eos, skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        chat_template_kwargs=request.chat_template_kwargs,
        parallel_tool_calls=request.parallel_tool_calls, logprobs=request.wants_logprobs,
        top_logprobs=request.top_logprobs if request.wants_logprobs else None,
        truncate_prompt_tokens=-1 if request.truncation == "auto" else None,
        structured_outputs=request.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
        if request.structured_outputs else None,
    )  # fmt: skip
    if request.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in request.tools]  # fmt: skip
    choice = request.tool_choice
    if request.tools or choice != "auto":  # "auto" is the Responses default: only with tools
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    fmt = request.text.format if request.text else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "schema", "schema": fmt.schema_, "strict": fmt.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "input"
        param = str(err["loc"][0]) if err["loc"] else "input"
        raise OpenAIError(f"{where}: {err['msg']}", param=_PARAMS.get(param, param)) from e


# the chat field a Responses field becomes: errors name the field the client sent
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text"}


def output_items(fields: dict, logprobs: list[dict] | None, incomplete: bool = False) -> list:
    """The chat output's fields (reasoning, content, tool calls) as output items, in that order."""
    items: list = []
    if fields.get("reasoning_content") is not None:
        items.append(ReasoningItem(content=[ReasoningContent(text=fields["reasoning_content"])]))
    calls = fields.get("tool_calls") or []
    if fields.get("content") is not None or not (items or calls):
        status = "incomplete" if incomplete else "completed"
        items.append(OutputMessage(status=status, content=[OutputText(text=fields.get("content") or "",
                                                                      logprobs=logprobs)]))
    for call in calls:
        items.append(FunctionCallOutput(call_id=call["id"], name=call["function"]["name"],
                                        arguments=call["function"]["arguments"]))  # fmt: skip
    return items


class _Events:
    """The Responses API's stream for one request: ``response.created``, then for each output item its
    ``output_item.added``, deltas and ``.done`` events, then ``response.completed`` (or
    ``response.incomplete``), as server-sent events named by their type."""

    def __init__(self, serving: OpenAIServingResponses, request: ResponsesRequest, response_id: str, prompt: Prompt,
                 messages: list[dict], parser: ChoiceOutput):  # fmt: skip
        self.serving, self.request, self.response_id = serving, request, response_id
        self.prompt, self.messages, self.parser = prompt, messages, parser
        self.seq = 0
        self.items: list = []  # done
        self.open: ReasoningItem | OutputMessage | FunctionCallOutput | None = None
        self.call_index: int | None = None  # the open function call's index in the parser's deltas
        self.text = ""  # the open item's text (reasoning, output text or arguments)
        # logprobs of tokens not yet on a text delta (a token whose text the detokenizer or parser holds back)
        self.pending_logprobs: list[dict] = []

    def event(self, type_: str, **fields) -> str:
        payload = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(payload)}\n\n"

    async def stream(self, first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]):
        final = None
        try:
            snapshot = self.serving.response(self.request, self.response_id, [], None, self.prompt).model_dump()
            yield self.event("response.created", response=snapshot)
            yield self.event("response.in_progress", response=snapshot)
            outputs = prepend(first, rest)
            async for _, out in outputs:
                self.pending_logprobs += self.serving.delta_logprobs(self.request, out)
                delta = self.parser.delta(out.delta_text) if out.delta_text else None
                if out.finished:
                    final = out
                    tail, _ = self.parser.finish(out.finish_reason)
                    for piece in (delta, tail):
                        for e in self.deltas(piece):
                            yield e
                    break
                for e in self.deltas(delta):
                    yield e
            for e in self.close(incomplete=final is not None and final.finish_reason == "length"):
                yield e
            items = self.items
            if final is not None and self.request.wants_logprobs:
                for item in items:
                    if isinstance(item, OutputMessage):
                        item.content[0].logprobs = self.serving._logprobs(self.request, final)
            response = self.serving.response(self.request, self.response_id, items, final, self.prompt)
            self.serving.keep(self.request, response, self.messages)
            done = "response.incomplete" if response.status == "incomplete" else "response.completed"
            yield self.event(done, response=response.model_dump())
        except Exception as e:
            info = to_openai_error(e, self.response_id).info
            yield self.event("error", code=info.code, message=info.message, param=info.param)
        finally:
            await rest.aclose()

    def deltas(self, piece: DeltaMessage | None) -> list[str]:
        if piece is None:
            return []
        events = []
        if piece.reasoning_content or piece.tool_calls:
            self.pending_logprobs = []  # as vLLM: logprobs ride on output text deltas only
        if piece.reasoning_content:
            events += self.switch(ReasoningItem, None)
            events.append(self.event("response.reasoning_text.delta", item_id=self.open.id,
                                     output_index=len(self.items), content_index=0,
                                     delta=piece.reasoning_content))  # fmt: skip
            self.text += piece.reasoning_content
        if piece.content:
            events += self.switch(OutputMessage, None)
            events.append(self.event("response.output_text.delta", item_id=self.open.id,
                                     output_index=len(self.items), content_index=0, delta=piece.content,
                                     logprobs=self.pending_logprobs))  # fmt: skip
            self.pending_logprobs = []
            self.text += piece.content
        for call in piece.tool_calls:
            if self.call_index != call.index:
                events += self.switch(FunctionCallOutput, call)
            if call.arguments:
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open.id,
                                         output_index=len(self.items), delta=call.arguments))  # fmt: skip
                self.text += call.arguments
        return events

    def switch(self, kind: type, call) -> list[str]:
        """Close the open item unless it is of ``kind`` (the same call), and open one of ``kind``."""
        if isinstance(self.open, kind) and call is None:
            return []
        events = self.close()
        index = len(self.items)
        if kind is ReasoningItem:
            self.open = ReasoningItem(status="in_progress")
            part = {"type": "reasoning_text", "text": ""}
        elif kind is OutputMessage:
            self.open = OutputMessage(status="in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            self.open = FunctionCallOutput(call_id=call.id or item_id("call"), name=call.name or "", arguments="",
                                           status="in_progress")  # fmt: skip
            self.call_index, part = call.index, None
        events.append(self.event("response.output_item.added", output_index=index, item=self.open.model_dump()))
        if part is not None:
            events.append(self.event("response.content_part.added", item_id=self.open.id, output_index=index,
                                     content_index=0, part=part))  # fmt: skip
        return events

    def close(self, incomplete: bool = False) -> list[str]:
        item, text, index = self.open, self.text, len(self.items)
        if item is None:
            return []
        self.open, self.call_index, self.text = None, None, ""
        events = []
        if isinstance(item, ReasoningItem):
            item = ReasoningItem(id=item.id, content=[ReasoningContent(text=text)])
            events.append(self.event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=text))  # fmt: skip
            events.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                     content_index=0, part=item.content[0].model_dump()))  # fmt: skip
        elif isinstance(item, OutputMessage):
            item = OutputMessage(id=item.id, status="incomplete" if incomplete else "completed",
                                 content=[OutputText(text=text)])  # fmt: skip
            events.append(self.event("response.output_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=text, logprobs=[]))  # fmt: skip
            events.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                     content_index=0, part=item.content[0].model_dump()))  # fmt: skip
        else:
            item = FunctionCallOutput(id=item.id, call_id=item.call_id, name=item.name, arguments=text)
            events.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                     name=item.name, arguments=text))  # fmt: skip
        self.items.append(item)
        events.append(self.event("response.output_item.done", output_index=index, item=item.model_dump()))
        return events

