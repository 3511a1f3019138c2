"""A prefill engine on per-rank streams tells its followers once that a request ended, however
it ended: after a success (the servicer aborts every request once its handoff is over), after
an abort while it was still being prefilled, and never for a request that went through rank 0.
That one ``DropBands`` is what deletes a follower's report from the group's store."""

from __future__ import annotations

from common.engine.factory import EngineSettings, build_engine
from common.engine.llm_engine import CacheConfig, EngineConfig
from common.engine.scheduler import SchedulerConfig
from common.parallel import prompt_state
from common.parallel.rank_streams import RankStreamPlan
from common.request_spec import RequestSpec
from common.sampling import SamplingParams
from prefill_service.engine import PrefillEngine, PrefillJob

PROMPT = tuple((i * 37 + 11) % 256 for i in range(23))  # 6 pages of 4, in chunks of 8 tokens
ONE = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
PLAN = RankStreamPlan("127.0.0.1", (1,), b"t" * 16, None, len(PROMPT), 4, 2)


class Followers:
    """Rank 0's link to its followers, recording what the engine tells them of bands (the
    forwards run on rank 0's whole model alone)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, bool]] = []  # (handoff, first page, with the state)
        self.dropped: list[int] = []

    def forward(self, batch_args, tables=None) -> None:
        pass

    def send_bands(self, handoff_id, plan, page_ids, start, slot) -> None:
        self.sent.append((handoff_id, start, slot is not None))

    def drop_bands(self, handoff_id) -> None:
        self.dropped.append(handoff_id)

    def gather_state(self, model, kv_pool, state_pool, page_ids, slot):
        # one rank's pools hold the whole model: its part is the full state
        return prompt_state.read_from_pools(kv_pool, state_pool, page_ids, slot)


def engine() -> tuple[PrefillEngine, Followers]:
    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=32, num_slots=3),
                          scheduler=SchedulerConfig(max_prefill_tokens=8,
                                                    reserve_output_tokens=False),
                          hold_after_prefill=True)
    built = build_engine(EngineSettings(model="tiny", engine=config))
    followers = built.engine.runner.followers = Followers()
    prefill = PrefillEngine(built.engine, built.layout, built.fingerprint)
    prefill.start()
    return prefill, followers


def test_every_end_of_a_request_on_per_rank_streams_drops_its_bands_once():
    prefill, followers = engine()
    try:
        # success: every chunk's pages were sent, the state with the last; then the handoff
        # is acknowledged and the servicer aborts the request, twice for good measure
        prefill.submit(PrefillJob(1, RequestSpec("a", PROMPT, ONE), rank_streams=PLAN)).result(60)
        assert followers.sent == [(1, 0, False), (1, 2, False), (1, 4, True)]
        assert followers.dropped == []
        prefill.abort(1).result(10)
        prefill.abort(1).result(10)
        assert followers.dropped == [1]

        # aborted while queued or being prefilled
        result = prefill.submit(PrefillJob(2, RequestSpec("b", PROMPT, ONE), rank_streams=PLAN))
        prefill.abort(2).result(10)
        assert followers.dropped == [1, 2]
        result.exception(10)  # resolved: PrefillAborted, or done just before the abort

        # through rank 0 (gathered): the followers hear nothing of bands
        sent = len(followers.sent)
        prefill.submit(PrefillJob(3, RequestSpec("c", PROMPT, ONE))).result(60)
        prefill.abort(3).result(10)
        assert followers.dropped == [1, 2] and len(followers.sent) == sent
    finally:
        prefill.stop()
