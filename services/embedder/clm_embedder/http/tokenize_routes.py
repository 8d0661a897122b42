"""vLLM 0.32's ``/tokenize`` and ``/detokenize`` (``vllm/entrypoints/serve/tokenize/``), with the model's tokenizer.

Clients count tokens with them before they send (to stay under the maximum
length, to estimate a bill). ``/tokenize`` takes a ``prompt`` or a chat
``messages`` list (then ``add_generation_prompt`` defaults to true, as in
vLLM); neither route has a length limit, as in vLLM.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from clm.encoders.tokenizer import TokenizerRefused
from clm_embedder.inputs import chat_request, check_chat_template
from clm_embedder.state import EmbedderState
from clm_http.errors import InvalidRequest, MalformedRequest, NotSupported, ResourceNotFound

from .protocol import CHAT_FLAGS_CONFLICT
from .routes import require_json

router = APIRouter()


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest as one body (``messages`` makes it a chat)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for a chat (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int] = Field(..., description="token ids (0 .. 2**63 - 1)")


def _tokenizer_of(request: Request, model: str | None):
    state: EmbedderState = request.app.state.embedder
    served = state.settings.served_model_name
    if model and model not in (served, state.backend.fingerprint.model):
        raise ResourceNotFound(f"The model `{model}` does not exist. Valid aliases: {served}.", param="model")
    if state.tokenizer is None:
        raise NotSupported("this embedder has no tokenizer")
    return state, state.tokenizer


@router.post("/tokenize", dependencies=[Depends(require_json)])
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state, tokenizer = _tokenizer_of(request, body.model)
    chat = None
    if body.messages is not None:
        if body.continue_final_message and body.add_generation_prompt:
            raise InvalidRequest(CHAT_FLAGS_CONFLICT)
        check_chat_template(body.chat_template, body.chat_template_kwargs)
        special = bool(body.add_special_tokens)
        chat = chat_request(body.messages, body.add_generation_prompt, body.continue_final_message,
                            body.chat_template_kwargs, special)
    elif body.prompt is not None:
        special = body.add_special_tokens is not False
    else:
        raise MalformedRequest("1 validation error:\n  {'type': 'missing', 'loc': 'body.prompt', 'msg': 'Field "
                               "required', 'input': 'None'}", param="body.prompt")
    try:
        tokens, token_strs = await tokenizer.tokenize(body.prompt, chat, special, bool(body.return_token_strs))
    except TokenizerRefused as error:
        raise InvalidRequest(str(error)) from None
    return {"count": len(tokens), "max_model_len": state.backend.fingerprint.max_tokens, "tokens": tokens,
            "token_strs": token_strs}


@router.post("/detokenize", dependencies=[Depends(require_json)])
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    _, tokenizer = _tokenizer_of(request, body.model)
    if any(not 0 <= token < 2**63 for token in body.tokens):
        bad = next(token for token in body.tokens if not 0 <= token < 2**63)
        raise MalformedRequest("1 validation error:\n  {'type': 'greater_than_equal', 'loc': 'body.tokens', "
                               f"'msg': 'Input should be greater than or equal to 0', 'input': {bad}}}",
                               param="body.tokens")
    try:
        return {"prompt": await tokenizer.detokenize(list(body.tokens))}
    except OverflowError as error:  # an id past the tokenizer's integer width: vLLM's 400 for OverflowError
        raise InvalidRequest(str(error)) from None
