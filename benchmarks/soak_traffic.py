"""The request kinds of the soak run (``benchmarks/soak.py``) and what counts as their success.

Each kind sends one request through the router's public API and returns an ``Outcome``: how it
ended ("completed", "cancelled" by the client on purpose, or a gRPC status name) and, for
greedy kinds, whether its tokens were the in-process oracle's. ``EXPECTED`` says which endings
are a kind's normal ones; anything else is a failure the soak reports. UNAVAILABLE is normal
for every kind that reaches the workers, since workers are killed under it.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import grpc

from common.convert import finish_reason_from_pb
from common.pb.flashsplit.v1 import generation_pb2_grpc
from common.sampling import SamplingParams
from router.remote import request_to_pb

GREEDY_TOKENS = 16
# (the request's fields, what a correct router answers) for requests that are the caller's fault
HOSTILE = (
    dict(params=SamplingParams(max_new_tokens=4, stop_token_ids=tuple(range(2000)))),
    dict(params=SamplingParams(max_new_tokens=4), request_id="r" * 4096),
    dict(params=SamplingParams(max_new_tokens=1_000_000)),
    dict(params=SamplingParams(max_new_tokens=4), text="x" * (3 << 20)),
)
# bytes that are not a GenerateRequest: truncated, and a text field that is not UTF-8
MALFORMED = (b"\x0a\xff\xff\xff", b"\x12\x03\xff\xfe\xfd")
GENERATE = "/flashsplit.v1.Generation/Generate"

_REACHES_WORKERS = {"completed", "UNAVAILABLE"}
EXPECTED = {
    "greedy": _REACHES_WORKERS,
    "greedy_no_spec": _REACHES_WORKERS,
    "tiny_temperature": _REACHES_WORKERS,
    "sampled": _REACHES_WORKERS,
    "cancelled": _REACHES_WORKERS | {"cancelled"},
    "deadline": _REACHES_WORKERS | {"DEADLINE_EXCEEDED"},
    "hostile": {"INVALID_ARGUMENT"},
}
WEIGHTS = {"greedy": 3, "greedy_no_spec": 1, "tiny_temperature": 1, "sampled": 2,
           "cancelled": 1, "deadline": 1, "hostile": 1}


@dataclass(frozen=True)
class Outcome:
    kind: str
    ending: str  # "completed", "cancelled" or a status name
    checked: bool = False  # its tokens were compared with the oracle's
    matched: bool = False

    @property
    def expected(self) -> bool:
        return self.ending in EXPECTED[self.kind] and (not self.checked or self.matched)


class Traffic:
    """Sends the soak's requests over one channel to the router."""

    def __init__(self, channel: grpc.aio.Channel, prompts: list[list[int]],
                 oracle: list[list[int]], rng: random.Random) -> None:
        self.stub = generation_pb2_grpc.GenerationStub(channel)
        self.channel = channel
        self.prompts = prompts
        self.oracle = oracle
        self.rng = rng

    def pick(self) -> str:
        kinds = list(WEIGHTS)
        return self.rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]

    async def send(self, kind: str) -> Outcome:
        try:
            return await getattr(self, f"_{kind}")(kind)
        except grpc.aio.AioRpcError as exc:
            return Outcome(kind, exc.code().name)

    async def _stream(self, request, timeout_s: float = 120.0, cancel_after: int | None = None
                      ) -> tuple[list[int], str]:
        call = self.stub.Generate(request, timeout=timeout_s)
        tokens, finish = [], ""
        async for msg in call:
            tokens.extend(msg.token_ids)
            finish = finish_reason_from_pb(msg.finish_reason) or finish
            if cancel_after is not None and len(tokens) >= cancel_after:
                call.cancel()
                return tokens, "cancelled"
        return tokens, finish

    async def check_greedy(self, index: int) -> Outcome:
        """Prompt ``index`` greedily, compared with the oracle (errors raise)."""
        return await self._checked("greedy", greedy(), index=index)

    async def _checked(self, kind: str, params: SamplingParams,
                       index: int | None = None) -> Outcome:
        i = self.rng.randrange(len(self.prompts)) if index is None else index
        tokens, _ = await self._stream(request_to_pb(token_ids=self.prompts[i], params=params))
        return Outcome(kind, "completed", checked=True, matched=tokens == self.oracle[i])

    async def _greedy(self, kind: str) -> Outcome:
        return await self._checked(kind, greedy())

    async def _greedy_no_spec(self, kind: str) -> Outcome:
        return await self._checked(kind, greedy(speculative=False))

    async def _tiny_temperature(self, kind: str) -> Outcome:
        # below the sampler's greedy threshold: the same tokens as temperature 0
        return await self._checked(kind, greedy(temperature=1e-300, top_p=0.9))

    async def _sampled(self, kind: str) -> Outcome:
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_new_tokens=24,
                                seed=self.rng.randrange(1 << 30), ignore_eos=True)
        tokens, finish = await self._stream(request_to_pb(token_ids=self._prompt(),
                                                          params=params))
        return Outcome(kind, "completed" if (finish, len(tokens)) == ("length", 24)
                       else f"wrong ending {finish} after {len(tokens)} tokens")

    async def _cancelled(self, kind: str) -> Outcome:
        params = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
        _, ending = await self._stream(request_to_pb(token_ids=self._prompt(), params=params),
                                       cancel_after=self.rng.randint(1, 8))
        return Outcome(kind, "cancelled" if ending == "cancelled" else "completed")

    async def _deadline(self, kind: str) -> Outcome:
        params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
        await self._stream(request_to_pb(token_ids=self._prompt(), params=params),
                           timeout_s=self.rng.uniform(0.02, 1.5))
        return Outcome(kind, "completed")

    async def _hostile(self, kind: str) -> Outcome:
        choice = self.rng.randrange(len(HOSTILE) + len(MALFORMED))
        if choice < len(HOSTILE):
            fields = dict(HOSTILE[choice])
            if "text" not in fields:
                fields["token_ids"] = self._prompt()
            await self._stream(request_to_pb(**fields), timeout_s=30)
        else:
            call = self.channel.unary_stream(GENERATE)(MALFORMED[choice - len(HOSTILE)],
                                                       timeout=30)
            async for _ in call:
                pass
        return Outcome(kind, "completed")  # a hostile request served is a failure

    def _prompt(self) -> list[int]:
        return self.prompts[self.rng.randrange(len(self.prompts))]


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=0.0, max_new_tokens=GREEDY_TOKENS,
                                    ignore_eos=True), **overrides})


async def run_clients(traffic: Traffic, clients: int, until: float) -> list[Outcome]:
    """``clients`` concurrent loops of requests until the loop's clock reaches ``until``."""
    loop = asyncio.get_running_loop()
    outcomes: list[Outcome] = []

    async def client() -> None:
        while loop.time() < until:
            outcomes.append(await traffic.send(traffic.pick()))

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes
