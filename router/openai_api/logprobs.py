"""Token log-probabilities in OpenAI's shapes.

Chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}``.
Completions (``logprobs: k``): ``{"tokens": [...], "token_logprobs": [...], "top_logprobs":
[{token: logprob, ...}, ...], "text_offset": [...]}``, where each ``top_logprobs`` map holds the
k most likely tokens and the generated one (OpenAI's "up to logprobs + 1" entries).

A token's text is its own decoding, special tokens included (``"token_id:N"`` for a model
without a tokenizer), and ``bytes`` its UTF-8 encoding, as vLLM reports them; ``text_offset`` is
where each token's text would start if those texts were concatenated. Streamed, each chunk
carries the entries of its own tokens, in order, so every token's entry is sent exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.logprobs import TokenLogprobs
from common.tokenizer import Tokenizer

# OpenAI's value for a token that is "very unlikely"; JSON has no -Infinity.
LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class ChoiceLogprobs:
    """Formats one choice's log-probabilities, in the order its tokens were generated (keeps
    the running ``text_offset`` of a streamed completion)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self._offset = 0
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) \
                or f"token_id:{token_id}"
            self._texts[token_id] = text
        return text

    def format(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict:
        """The ``logprobs`` object for ``token_ids`` (the next tokens of the choice)."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(logprobs)} log-probabilities for {len(token_ids)} tokens")
        return self._chat(token_ids, logprobs) if self.chat else \
            self._completion(token_ids, logprobs)

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}

    def _chat(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict:
        content = [{**self._entry(t, lp.logprob),
                    "top_logprobs": [self._entry(i, v) for i, v in lp.top]}
                   for t, lp in zip(token_ids, logprobs)]
        return {"content": content, "refusal": None}

    def _completion(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict:
        tokens, offsets, top = [], [], []
        for t, lp in zip(token_ids, logprobs):
            text = self.token_text(t)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            alternatives = {self.token_text(i): _value(v) for i, v in lp.top}
            alternatives.setdefault(text, _value(lp.logprob))
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [_value(lp.logprob) for lp in logprobs],
                "top_logprobs": top, "text_offset": offsets}
