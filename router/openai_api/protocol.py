"""The request bodies of the HTTP API, and what they mean for the router.

Field names and defaults are OpenAI's (``max_tokens`` defaults to 16 for completions and to the
rest of the context for chat), plus the extensions vLLM and SGLang accept (``top_k``, ``min_p``,
``stop_token_ids``, ``ignore_eos``, ``chat_template_kwargs``, ``add_generation_prompt``,
``return_token_ids``) and flashsplit's ``speculative``. Unknown fields are ignored, as
OpenAI-compatible servers do; fields that are known but cannot be honoured yet
(penalties, tools, ...) are refused with a 400 that says so, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field

from common.logprobs import MAX_LOGPROBS
from common.sampling import SamplingParams
from router.openai_api.errors import ApiError, invalid, not_supported

# Choices of one HTTP request (prompts × n): each is a request on the workers.
MAX_CHOICES = 64
# Internal names in SamplingParams' messages -> the API's field names, for the error's ``param``.
_PARAM_NAMES = MappingProxyType({
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "seed": "seed", "max_new_tokens": "max_tokens", "stop_token_ids": "stop_token_ids"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class GenerationFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    speculative: bool | None = None
    return_token_ids: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_common(self, num_prompts: int) -> None:
        """Refuse what this server cannot honour (ApiError)."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise invalid(f"n must be between 1 and {MAX_CHOICES}, got {self.n}", "n")
        if num_prompts * self.n > MAX_CHOICES:
            raise invalid(f"{num_prompts} prompts x n={self.n} is more than {MAX_CHOICES} "
                          "completions in one request", "n")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true",
                          "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise not_supported(name, name)
        if self.repetition_penalty not in (None, 1.0):
            raise not_supported("repetition_penalty", "repetition_penalty")
        if self.logit_bias:
            raise not_supported("logit_bias", "logit_bias")

    def num_logprobs(self) -> int | None:
        """Alternatives per token the request asks for; None: no log-probabilities."""
        return None

    def sampling(self, max_tokens: int, choice: int) -> SamplingParams:
        """The choice's sampling settings; unset fields take SamplingParams' defaults.

        With a seed, choice i samples with seed + i, so choice 0 is what n=1 gives.
        """
        values: dict[str, Any] = {"max_new_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                                  "logprobs": self.num_logprobs(),
                                  "speculative": self.speculative}
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.seed is not None:
            values["seed"] = self.seed + choice
        if self.stop_token_ids:
            values["stop_token_ids"] = tuple(self.stop_token_ids)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise invalid(str(exc).replace("max_new_tokens", "max_tokens"),
                          _PARAM_NAMES.get(name)) from None


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``: ``prompt`` is text, texts, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]
        else:
            out = list(p)
        if not out:
            raise invalid("prompt is empty", "prompt")
        return out

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        _check_range(self.logprobs, "logprobs")
        if self.echo:
            raise not_supported("echo", "echo")
        if self.suffix:
            raise not_supported("suffix", "suffix")
        if self.best_of not in (None, self.n):
            raise not_supported("best_of other than n", "best_of")
        self.check_common(len(self.prompts()))


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        _check_range(self.top_logprobs, "top_logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if self.tools:
            raise not_supported("tool calling", "tools")
        if self.tool_choice not in (None, "none"):
            raise not_supported("tool_choice", "tool_choice")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise not_supported("response_format other than text", "response_format")
        if not self.messages:
            raise invalid("messages is empty", "messages")
        reserved = {"messages", "add_generation_prompt"} & set(self.chat_template_kwargs)
        if reserved:
            raise invalid(f"chat_template_kwargs may not set {sorted(reserved)}; they are "
                          "fields of the request", "chat_template_kwargs")
        self.check_common(1)

    def max_tokens_or(self, rest_of_context: int) -> int:
        """max_completion_tokens, else max_tokens, else the rest of the context (as vLLM)."""
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return max(rest_of_context, 1)


def _check_range(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise invalid(f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}", param)


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: content as one string.

    OpenAI clients may send content as a list of parts; text parts are joined with newlines (as
    vLLM does for templates that take strings). Other parts (images, audio) are refused.
    """
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"messages[{i}] has no role", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise ApiError(grpc.StatusCode.UNIMPLEMENTED,
                                   f"messages[{i}]: content parts other than text are not "
                                   "supported yet", param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of parts",
                          f"messages[{i}].content")
        out.append({**m, "content": content})
    return out
