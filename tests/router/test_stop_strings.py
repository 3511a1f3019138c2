"""Stop strings on their own (``StopStringMatcher``) and inside ``OutputTracker``."""

from __future__ import annotations

import random

import pytest

from common.tokenizer import ByteTokenizer
from router.requests import OutputTracker
from router.stop_strings import MAX_STOP_STRINGS, StopStringMatcher, check_stop_strings


def reference(text: str, stops) -> tuple[str, str | None]:
    """The text cut before the earliest occurrence of any stop string."""
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    pos, s = min(hits, key=lambda h: h[0])
    return text[:pos], s


def stream(matcher: StopStringMatcher, pieces) -> tuple[list[str], str]:
    out = [matcher.push(p) for p in pieces]
    out.append(matcher.flush())
    return out, "".join(out)


def test_a_stop_string_split_over_pieces_is_never_emitted():
    m = StopStringMatcher(["STOP"])
    out, text = stream(m, ["abc S", "T", "O", "P tail"])
    assert text == "abc " and m.matched == "STOP"
    # "S", "T", "O" were held back while they could still begin "STOP"
    assert out == ["abc ", "", "", "", ""]


def test_held_back_text_is_released_when_it_cannot_start_a_stop_string():
    m = StopStringMatcher(["\n\n"])
    assert m.push("one\n") == "one"
    assert m.push("two") == "\ntwo"
    assert m.push("\n") == ""
    assert m.flush() == "\n" and m.matched is None


def test_the_earliest_match_wins_over_list_order():
    m = StopStringMatcher(["world", "lo"])
    _, text = stream(m, ["hel", "lo wor", "ld"])
    assert text == "hel" and m.matched == "lo"


def test_overlapping_prefixes():
    # "aab": the first "a" cannot start "ab" once the second "a" arrives, the second one can
    m = StopStringMatcher(["ab"])
    assert m.push("a") == ""
    assert m.push("a") == "a"
    assert m.push("b") == "" and m.matched == "ab"
    assert m.push("more") == "" and m.flush() == ""


def test_no_stop_strings_passes_everything_through():
    m = StopStringMatcher([])
    assert m.push("abc") == "abc" and m.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_random_streams_equal_the_reference(seed):
    rng = random.Random(seed)
    alphabet = "ab\n é"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
             for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(60))
    cuts = sorted(rng.sample(range(1, len(text)), 15))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    m = StopStringMatcher(stops)
    _, out = stream(m, pieces)
    assert (out, m.matched) == reference(text, stops)


def test_checks():
    assert check_stop_strings(["a", "b", "a"]) == ("a", "b")
    for bad in ("abc", [""], [3], [str(i) for i in range(MAX_STOP_STRINGS + 1)],
                ["x" * 257]):
        with pytest.raises(ValueError):
            check_stop_strings(bad)


def track(stop, events, finish="length"):
    """Feed token events through an OutputTracker; return its deltas."""
    t = OutputTracker(ByteTokenizer(), prompt_ids=[1], arrival=0.0, stop=stop)
    deltas = []
    for i, ids in enumerate(events):
        last = i == len(events) - 1
        deltas.append(t.add(ids, float(i + 1), finish_reason=finish if last else None))
        if deltas[-1].finish_reason is not None:
            break
    return t, deltas


def test_tracker_cuts_ids_and_text_at_the_token_that_completes_the_match():
    ids = list("Héllo, wörld!".encode())
    # one event of 4 tokens: the match ends inside it, so later tokens are dropped
    events = [ids[:3], ids[3:7], ids[7:11], ids[11:]]
    t, deltas = track(["o, w"], events)
    assert "".join(d.text for d in deltas) == "Héll" == t.text
    assert deltas[-1].finish_reason == "stop"
    end = bytes(ids).index(b"o, w") + len(b"o, w")
    assert t.token_ids == ids[:end]
    assert deltas[-1].completion_tokens == end
    assert len(deltas[-1].timings.inter_token_latencies_s) == end - 1
    assert len(deltas) == 3  # the fourth event is never read


def test_tracker_matches_a_multibyte_stop_string_split_inside_a_character():
    ids = list("ab✓cd".encode())  # ✓ is three bytes, each its own token
    t, deltas = track(["✓"], [[i] for i in ids])
    assert t.text == "ab" and deltas[-1].finish_reason == "stop"
    assert t.token_ids == ids[:5]
    assert all("\ufffd" not in d.text for d in deltas)


def test_tracker_without_a_match_releases_held_text_at_the_end():
    ids = list(b"abcS")
    t, deltas = track(["STOP"], [[i] for i in ids], finish="length")
    assert t.text == "abcS" and deltas[-1].finish_reason == "length"
    assert deltas[-1].text == "S"  # held back until the request ended
