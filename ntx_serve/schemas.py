"""The OpenAI request bodies we accept (pydantic, strict types) and the JSON we answer with.

Unknown fields are ignored, as clients send many optional ones (`logprobs: false`, `user`, ...);
the fields we use are checked strictly, so `"max_tokens": "10"` is a 400, not a silent 10.
`top_k`, `min_p` and `repeat_penalty` are llama.cpp-server extensions; off unless given.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

from ntx_engine.sampler import SamplerConfig

Number = Union[StrictInt, StrictFloat]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None

    def as_template_dict(self) -> dict:
        """What the chat template sees: role and plain-text content (text parts joined)."""
        if isinstance(self.content, list):
            text = "".join(p.text or "" for p in self.content if p.type == "text")
        else:
            text = self.content or ""
        role = "system" if self.role == "developer" else self.role  # templates predate "developer"
        return {"role": role, "content": text}


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    max_tokens: Optional[StrictInt] = Field(None, ge=0)
    temperature: Number = Field(1.0, ge=0, le=2)
    top_p: Number = Field(1.0, gt=0, le=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[StrictInt] = Field(None, ge=0, lt=2**64)
    n: StrictInt = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    top_k: StrictInt = Field(0, ge=0)
    min_p: Number = Field(0.0, ge=0, le=1)
    repeat_penalty: Number = Field(1.0, gt=0)

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampler(self) -> SamplerConfig:
        return SamplerConfig(temperature=float(self.temperature), top_k=self.top_k, top_p=float(self.top_p),
                             min_p=float(self.min_p), repeat_penalty=float(self.repeat_penalty), seed=self.seed)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=0)

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[StrictInt]]
    max_tokens: Optional[StrictInt] = Field(16, ge=0)  # the completions API's documented default
    echo: bool = False

    def requested_tokens(self) -> int | None:
        return self.max_tokens


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_response(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": use}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_response(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(chunk: dict, use: dict) -> dict:
    """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
    return {**chunk, "choices": [], "usage": use}
