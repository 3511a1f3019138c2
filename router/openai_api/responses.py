"""The JSON objects the HTTP API answers with, shaped as OpenAI's.

Unary answers are ``text_completion`` / ``chat.completion`` objects; streamed ones are a series
of chunks (``text_completion`` / ``chat.completion.chunk``) sent as server-sent events, each
``data: <json>`` and a blank line, ending with ``data: [DONE]``. With
``stream_options.include_usage`` every chunk carries ``"usage": null`` and one more chunk with no
choices carries the usage, as OpenAI sends it. ``return_token_ids`` (a vLLM extension) adds each
choice's token ids (``token_ids``, and ``prompt_token_ids`` once). With log-probabilities asked
for, each choice (and each chunk with tokens) carries its ``logprobs`` object
(``router/openai_api/logprobs.py``); otherwise ``logprobs`` is null.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj``."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class Head:
    """What every object of one HTTP request repeats."""

    id: str
    created: int
    model: str
    chat: bool

    def obj(self, object_name: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices, **extra}


@dataclass(frozen=True)
class FinishedChoice:
    """One choice once its request ended."""

    index: int
    text: str
    finish_reason: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    logprobs: dict | None = None  # the choice's logprobs object, when asked for


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def unary(head: Head, choices: Sequence[FinishedChoice], prompt_tokens: int,
          token_ids: bool) -> dict:
    """The whole answer: a ``text_completion`` or a ``chat.completion``."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        choice: dict[str, Any] = {"index": c.index}
        if head.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choice.update(logprobs=c.logprobs, finish_reason=c.finish_reason)
        if token_ids:
            choice.update(token_ids=list(c.token_ids), prompt_token_ids=list(c.prompt_token_ids))
        out.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return head.obj("chat.completion" if head.chat else "text_completion", out,
                    usage=usage(prompt_tokens, completion_tokens))


class ChunkWriter:
    """Turns the deltas of a streamed request into server-sent events."""

    def __init__(self, head: Head, include_usage: bool, token_ids: bool) -> None:
        self.head = head
        self.include_usage = include_usage
        self.token_ids = token_ids
        self._object = "chat.completion.chunk" if head.chat else "text_completion"

    def _event(self, choice: dict) -> str:
        extra = {"usage": None} if self.include_usage else {}
        return sse(self.head.obj(self._object, [choice], **extra))

    def start(self, index: int, prompt_token_ids: Sequence[int]) -> str:
        """Chat: the first chunk of a choice names the role (OpenAI sends it before any text)."""
        if not self.head.chat:
            return ""
        choice: dict[str, Any] = {"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}
        if self.token_ids:
            choice["prompt_token_ids"] = list(prompt_token_ids)
        return self._event(choice)

    def delta(self, index: int, text: str, token_ids: Sequence[int],
              finish_reason: str | None, logprobs: dict | None = None) -> str:
        """Events for new text or tokens (none when there is nothing to say) and, at the end,
        the finish. ``logprobs``: the object for this delta's tokens, when asked for (a chunk
        carries it even when its text is held back, so no token's entry is lost)."""
        events = []
        if text or (token_ids and (self.token_ids or logprobs is not None)):
            choice: dict[str, Any] = {"index": index}
            if self.head.chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            choice.update(logprobs=logprobs, finish_reason=None)
            if self.token_ids:
                choice["token_ids"] = list(token_ids)
            events.append(choice)
        if finish_reason is not None:
            if self.head.chat or not events:
                events.append({"index": index, **({"delta": {}} if self.head.chat
                                                  else {"text": ""}),
                               "logprobs": None, "finish_reason": finish_reason})
            else:  # a completion's last text and its finish travel in one chunk
                events[-1]["finish_reason"] = finish_reason
        return "".join(self._event(c) for c in events)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> str:
        """The closing usage chunk (empty unless include_usage)."""
        if not self.include_usage:
            return ""
        return sse(self.head.obj(self._object, [], usage=usage(prompt_tokens,
                                                               completion_tokens)))

    @staticmethod
    def error(body: dict) -> str:
        """A failure after the stream began: an event with the error, as vLLM sends it."""
        return sse(body)
