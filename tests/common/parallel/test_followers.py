"""common/parallel/followers.py and a tensor-parallel engine's step failures, in one process:
a stand-in process group stands for the other ranks (its all-reduce adds nothing, its gather
repeats this rank's part, its broadcast records what rank 0 sent)."""

from __future__ import annotations

import pickle

import pytest
import torch

from common.engine.errors import GroupOutOfStep, StepFailed
from common.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
from common.model.forward_batch import ForwardMode
from common.model.load import load_model
from common.parallel.followers import (Follower, FollowerLink, RunForward, ShardSettings,
                                       Stop)
from common.parallel.group import TensorParallelGroup
from common.sampling import SamplingParams
from tests.common.parallel.stand_in_group import Done, NoOtherRank

CACHE = CacheConfig(page_size=4, num_pages=16, num_slots=3)


class LonelyGroup(NoOtherRank):
    """A process group whose other ranks contribute nothing; ``sent`` keeps rank 0's
    broadcasts, and a follower's broadcasts deliver ``inbox`` in turn."""

    def __init__(self, inbox=()) -> None:
        self.sent: list[torch.Tensor] = []
        self.inbox = [self._encode(m) for m in inbox]

    @staticmethod
    def _encode(message) -> list[torch.Tensor]:
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        return [torch.tensor([payload.numel()]), payload]

    def broadcast(self, tensor, root):
        if self.inbox:
            tensor.copy_(self.inbox[0].pop(0))
            if not self.inbox[0]:
                self.inbox.pop(0)
        else:
            self.sent.append(tensor.clone())
        return Done()


def group(rank: int, pg) -> TensorParallelGroup:
    return TensorParallelGroup(rank, 2, pg, pg)


def test_only_rank_zero_sends_and_only_the_others_follow():
    with pytest.raises(ValueError, match="only rank 0 sends"):
        FollowerLink(group(1, LonelyGroup()))
    with pytest.raises(ValueError, match="rank 0 drives"):
        Follower(group(0, LonelyGroup()), "cpu")


def test_a_failed_forward_after_the_broadcast_stops_the_engine():
    pg = LonelyGroup()
    model = load_model("tiny", tp=group(0, pg))
    engine = LLMEngine(model, EngineConfig(cache=CACHE))
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=2))

    def broken(*args, **kwargs):
        raise ValueError("no room on rank 0")

    model.forward = broken
    with pytest.raises(GroupOutOfStep, match="no room on rank 0") as caught:
        engine.step()
    assert not isinstance(caught.value, StepFailed)
    sent = pickle.loads(pg.sent[1].numpy().tobytes())  # [0] is its length
    assert isinstance(sent, RunForward) and sent.batch_args["token_ids"] == [[1, 2, 3]]


def test_a_follower_zeroes_the_slot_of_a_prompt_that_starts_from_nothing():
    # ids among rank 1's vocabulary rows: with no other rank, the others' would embed as zeros
    args = dict(mode=ForwardMode.EXTEND, token_ids=[[200, 201, 202]], prefix_lens=[0],
                page_ids=[[1]], page_size=CACHE.page_size, state_slots=[1],
                return_all_logits=False)
    settings = ShardSettings("tiny", None, None, CACHE)

    def follow(dirty: bool) -> Follower:
        follower = Follower(group(1, LonelyGroup()), "cpu")
        follower.load(settings)
        if dirty:  # what an earlier request left in the slot
            follower.state_pool.conv[:, 1] = 3.0
            follower.state_pool.ssm[:, 1] = 3.0
        follower.forward(args)
        return follower

    clean, reused = follow(dirty=False), follow(dirty=True)
    assert clean.state_pool.ssm[:, 1].abs().sum() > 0
    assert torch.equal(reused.state_pool.conv, clean.state_pool.conv)
    assert torch.equal(reused.state_pool.ssm, clean.state_pool.ssm)


def test_a_follower_runs_until_stop():
    args = dict(mode=ForwardMode.EXTEND, token_ids=[[200, 201]], prefix_lens=[0], page_ids=[[1]],
                page_size=CACHE.page_size, state_slots=[1], return_all_logits=False)
    from common.parallel.followers import LoadModel

    follower = Follower(group(1, LonelyGroup([LoadModel(ShardSettings("tiny", None, None, CACHE)),
                                              RunForward(args), Stop()])), "cpu")
    follower.run()
    assert follower.model is not None and follower.state_pool.ssm[:, 1].abs().sum() > 0


class RecordingBands:
    """A worker's band handler that keeps what it was given."""

    def __init__(self, tp, follower) -> None:
        self.tp, self.follower = tp, follower
        self.handled: list = []
        self.closed = False

    def handle(self, message) -> None:
        self.handled.append(message)

    def close(self) -> None:
        self.closed = True


def test_band_messages_go_to_the_workers_handler_and_without_one_are_refused():
    from common.parallel.band_messages import DropBands

    drop = DropBands(7)
    follower = Follower(group(1, LonelyGroup([drop, Stop()])), "cpu", RecordingBands)
    follower.run()
    bands = follower.bands
    assert bands.follower is follower and bands.tp is follower.tp
    assert bands.handled == [drop] and bands.closed
    bare = Follower(group(1, LonelyGroup([drop])), "cpu")
    with pytest.raises(TypeError, match="DropBands: this follower was started without a band"):
        bare.run()
