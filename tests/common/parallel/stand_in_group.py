"""A stand-in for the process groups of a rank with no other rank beside it: every collective
is a no-op (an all-gather repeats this rank's part), so one process can build and run any
rank's shard. Two kernel sets compared on the same shard see the same collectives."""

from __future__ import annotations


class Done:
    def wait(self) -> None:
        pass


class NoOtherRank:
    def allreduce(self, tensors):
        return Done()

    def allgather(self, outputs, inputs):
        for out in outputs[0]:
            out.copy_(inputs[0])
        return Done()
