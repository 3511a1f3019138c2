"""Stop strings: end a request when its text contains one, without ever emitting it.

Workers see token ids only, so stop strings are matched by the router on the detokenized text.
A stop string can span several tokens ("\\n\\n" as two "\\n" tokens, or a word split anywhere), so
the matcher holds back the end of the text while it could still be the beginning of a stop string,
and releases it once it cannot (or at the end of the request). Text before the first match is
emitted; the match and everything after it are not.
"""

from __future__ import annotations

from collections.abc import Sequence

# Bounds on what one request may ask for: each stop string is searched in the held-back text at
# every token, so their number and length bound the router's work per token.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def check_stop_strings(stops: Sequence[str]) -> tuple[str, ...]:
    """The stop strings, validated and without duplicates; ValueError for a caller mistake."""
    if isinstance(stops, str):
        raise ValueError("stop strings must be a list of strings, not one string")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    out = tuple(dict.fromkeys(stops))
    if len(out) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(out)}")
    for s in out:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} "
                             f"characters, got one of {len(s)}")
    return out


class StopStringMatcher:
    """Streams text through, cut before the first occurrence of any stop string.

    ``push`` returns the text that is final (it can no longer be part of a stop string);
    ``flush`` returns what is still held back, once no more text will come. After a match,
    ``matched`` is the stop string found and every later call returns "".
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = check_stop_strings(stops)
        self.matched: str | None = None
        self._pending = ""

    def push(self, text: str) -> str:
        """Add text; return the part of it (and of earlier held-back text) that is final."""
        if self.matched is not None:
            return ""
        buf = self._pending + text
        if not self.stops:
            return buf
        first: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.matched = first[1]
            self._pending = ""
            return buf[:first[0]]
        # Any match still to come must start inside the longest end of buf that is a proper
        # prefix of some stop string (a match wholly inside buf was found above), so only that
        # end is held back.
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._pending = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, released because the request ended without a match."""
        out, self._pending = ("" if self.matched is not None else self._pending), ""
        return out
