"""POST /tokenize and /detokenize, in vLLM's shapes (users script against them)."""

from __future__ import annotations

from aiohttp import web

from dpu_frontend.engine.service import Service
from dpu_frontend.http.chat import render
from dpu_frontend.http.schemas import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_model,
    load_json,
    parse,
)


class TokenizeHandlers:
    def __init__(self, service: Service, model_name: str) -> None:
        self.service = service
        self.model_name = model_name

    def _check_model(self, model: str | None) -> None:
        check_model(model, self.model_name)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.read()
        if isinstance(data := load_json(body), dict) and "messages" in data:
            chat = parse(TokenizeChatRequest, body)
            self._check_model(chat.model)
            text = await self.service.off_loop(
                render, self.service.chat_template, chat.messages, chat.add_generation_prompt,
                chat.continue_final_message, chat.chat_template_kwargs)
            tokens = await self.service.tokenize(text, add_special_tokens=chat.add_special_tokens)
        else:
            req = parse(TokenizeCompletionRequest, body)
            self._check_model(req.model)
            tokens = await self.service.tokenize(req.prompt,
                                                 add_special_tokens=req.add_special_tokens)
        return web.json_response({"count": len(tokens), "max_model_len": self.service.max_model_len,
                                  "tokens": tokens, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        req = parse(DetokenizeRequest, await request.read())
        self._check_model(req.model)
        self.service.check_ids(req.tokens, "tokens")
        return web.json_response({"prompt": await self.service.detokenize(req.tokens)})
