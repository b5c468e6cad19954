"""``POST /tokenize`` and ``POST /detokenize``, as vLLM has them: a text (or chat messages
through the chat template) to token ids and back, with no length limit but the body size."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from atom.engine.input_processor import InvalidInputError
from atom.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    random_id,
)
from atom.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest):
        return await self.serve(random_id("tokenize"), self._tokenize(request))

    async def detokenize(self, request: DetokenizeRequest):
        return await self.serve(random_id("detokenize"), self._detokenize(request))

    async def _tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest):
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            tools = [t.model_dump(exclude_unset=True) for t in request.tools or []]  # as tool_plan gives them
            prompt = await self.render_chat(request, tools, add_special_tokens=request.add_special_tokens,
                                            check_length=False)  # fmt: skip
        else:
            prompt = await self.engine.tokenize(request.prompt, request.add_special_tokens, check_length=False)
        ids = prompt.token_ids
        strs = [self.token_str(t) for t in ids] if request.return_token_strs else None
        response = TokenizeResponse(
            count=len(ids), max_model_len=self.engine.config.model_config.max_model_len, tokens=ids, token_strs=strs
        )
        return JSONResponse(response.model_dump())

    async def _detokenize(self, request: DetokenizeRequest):
        self.check_model(request.model)
        vocab = self.engine.config.model_config.hf_config.vocab_size
        if any(t >= vocab for t in request.tokens):
            raise InvalidInputError(f"token ids must be in [0, {vocab})", "tokens")
        return JSONResponse(DetokenizeResponse(prompt=await self.engine.detokenize(request.tokens)).model_dump())
