import asyncio

import grpc
import pytest

from common.load_report import LoadReport
from common.security import TOKEN_ENV
from router.__main__ import build_parser, config_from_args
from router.client import WorkerCallError, WorkerTimeout
from router.registry import RegistryConfig, WorkerRegistry, backoff_delay


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(answers, **cfg):
    """A registry over one prefill 'p' and one decode 'd'; answers[address] is a report or error."""
    calls = []

    async def fetch(address, kind):
        calls.append(address)
        a = answers[address]
        if isinstance(a, Exception):
            raise a
        return a

    clock = FakeClock()
    config = RegistryConfig(backoff_initial_s=1.0, backoff_max_s=5.0, backoff_multiplier=2.0,
                            **cfg)
    reg = WorkerRegistry([("p", "prefill"), ("d", "decode")], fetch, config, clock)
    return reg, clock, calls


def test_backoff_grows_and_caps():
    c = RegistryConfig(backoff_initial_s=1.0, backoff_max_s=5.0, backoff_multiplier=2.0)
    assert [backoff_delay(c, n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_poll_marks_up_and_stores_report():
    answers = {"p": LoadReport("prefill", queue_len=3), "d": LoadReport("decode", free_slots=2,
                                                                        total_slots=4)}
    reg, _, _ = make(answers)
    assert not reg.get("p").healthy  # nothing is trusted before it answered
    asyncio.run(reg.poll_once())
    assert reg.get("p").healthy and reg.get("p").load.queue_len == 3
    assert reg.get("d").view().free_slots == 2


def test_down_worker_retried_with_backoff_and_comes_back():
    answers = {"p": ConnectionError("refused"), "d": LoadReport("decode")}
    reg, clock, calls = make(answers)
    asyncio.run(reg.poll_once())
    w = reg.get("p")
    assert not w.healthy and w.consecutive_failures == 1 and w.last_error == "refused"
    assert w.next_retry_at == 101.0

    calls.clear()
    clock.now = 100.5
    asyncio.run(reg.poll_once())  # backoff not over: only the healthy decode is asked
    assert calls == ["d"]

    clock.now = 101.0
    asyncio.run(reg.poll_once())  # second failure doubles the wait
    assert w.consecutive_failures == 2 and w.next_retry_at == 103.0

    answers["p"] = LoadReport("prefill")
    clock.now = 102.9
    asyncio.run(reg.poll_once())
    assert not w.healthy
    clock.now = 103.0
    asyncio.run(reg.poll_once())
    assert w.healthy and w.consecutive_failures == 0 and w.last_error == ""


def test_mark_failed_takes_worker_out_until_it_answers_again():
    answers = {"p": LoadReport("prefill"), "d": LoadReport("decode")}
    reg, clock, _ = make(answers)
    asyncio.run(reg.poll_once())
    reg.mark_failed("d", "stream broke")
    assert not reg.get("d").healthy and reg.get("d").last_error == "stream broke"
    assert [v.address for v in reg.views() if v.healthy] == ["p"]
    clock.now += 1.0
    asyncio.run(reg.poll_once())
    assert reg.get("d").healthy


def test_a_worker_that_never_answered_is_not_taken_by_a_timeout():
    async def never(address, kind):
        await asyncio.sleep(10)

    reg = WorkerRegistry([("p", "prefill")], never, RegistryConfig(poll_timeout_s=0.05))
    asyncio.run(reg.poll_once())
    assert not reg.get("p").healthy and "no load report" in reg.get("p").last_error


@pytest.mark.parametrize("late", [
    lambda: TimeoutError("prefill.GetLoad on p: DEADLINE_EXCEEDED"),
    lambda: WorkerTimeout("p", "prefill.GetLoad", grpc.StatusCode.DEADLINE_EXCEEDED, "late"),
], ids=["registry's own", "call's deadline"])
def test_a_healthy_worker_stays_up_until_it_misses_enough_polls_in_a_row(late):
    answers = {"p": LoadReport("prefill", free_slots=2, total_slots=2),
               "d": LoadReport("decode")}
    reg, clock, _ = make(answers, misses_before_down=3)
    asyncio.run(reg.poll_once())
    answers["p"] = late()
    for _ in range(2):  # two late answers: still in rotation, on its last report
        asyncio.run(reg.poll_once())
        assert reg.get("p").healthy and reg.get("p").load.free_slots == 2
    answers["p"] = LoadReport("prefill", free_slots=1, total_slots=2)  # an answer in time resets the count
    asyncio.run(reg.poll_once())
    answers["p"] = late()
    for _ in range(2):
        asyncio.run(reg.poll_once())
        assert reg.get("p").healthy
    asyncio.run(reg.poll_once())  # the third in a row
    assert not reg.get("p").healthy and "DEADLINE_EXCEEDED" in reg.get("p").last_error
    assert reg.get("p").consecutive_failures == 1  # backed off as any failure


def test_an_error_answer_takes_a_healthy_worker_down_at_once():
    answers = {"p": LoadReport("prefill"), "d": LoadReport("decode")}
    reg, _, _ = make(answers, misses_before_down=3)
    asyncio.run(reg.poll_once())
    answers["p"] = WorkerCallError("p", "prefill.GetLoad", grpc.StatusCode.UNAVAILABLE,
                                   "connection refused")
    asyncio.run(reg.poll_once())
    assert not reg.get("p").healthy and "connection refused" in reg.get("p").last_error


def test_misses_before_down_must_be_positive():
    with pytest.raises(ValueError, match="misses_before_down"):
        RegistryConfig(misses_before_down=0)


def test_wrong_kind_is_a_failure():
    reg, _, _ = make({"p": LoadReport("decode"), "d": LoadReport("decode")})
    asyncio.run(reg.poll_once())
    assert not reg.get("p").healthy and "decode" in reg.get("p").last_error


def test_in_flight_and_note_full():
    answers = {"p": LoadReport("prefill"), "d": LoadReport("decode", free_slots=3, total_slots=4,
                                                           free_pages=9, total_pages=9)}
    reg, _, _ = make(answers)
    asyncio.run(reg.poll_once())
    release = reg.assign("p", "d")
    assert reg.get("p").in_flight == 1 and reg.get("d").view().in_flight == 1
    release()
    release()  # idempotent
    assert reg.get("p").in_flight == 0
    reg.note_full("d")
    assert reg.get("d").healthy and reg.get("d").view().free_slots == 0


def test_bad_worker_list():
    with pytest.raises(ValueError):
        WorkerRegistry([("a", "prefill"), ("a", "decode")], None)
    with pytest.raises(ValueError):
        WorkerRegistry([("a", "router")], None)


def test_answer_to_a_poll_sent_before_a_failure_does_not_revive_the_worker():
    reg, clock, _ = make({"p": LoadReport("prefill"), "d": LoadReport("decode")})
    asyncio.run(reg.poll_once())
    asked_at = clock.now
    clock.now += 0.1
    reg.mark_failed("d", "stream broke")
    reg.record_success("d", LoadReport("decode"), asked_at)  # the overlapping poll's answer
    assert not reg.get("d").healthy


def test_reconcile_adds_new_workers_unhealthy_and_retires_missing_ones():
    answers = {"p": LoadReport("prefill"), "d": LoadReport("decode"), "d2": LoadReport("decode")}
    reg, _, calls = make(answers)
    asyncio.run(reg.poll_once())
    reg.reconcile({"p": "prefill", "d2": "decode"})
    assert [w.address for w in reg.workers()] == ["p", "d2"]
    assert not reg.get("d2").healthy  # nothing is trusted before it answered
    assert reg.get("d").healthy  # retired, not down: its row is kept while held
    assert "d" not in [v.address for v in reg.views()]
    calls.clear()
    asyncio.run(reg.poll_once())
    assert sorted(calls) == ["d2", "p"]  # a retired worker is no longer polled
    assert reg.get("d2").healthy
    assert reg.reap() == ["d"]
    with pytest.raises(KeyError):
        reg.get("d")
    reg.record_success("d", LoadReport("decode"))  # a late answer for it is dropped
    reg.mark_failed("d", "late failure")
    reg.note_full("d")
    assert [w.address for w in reg.workers()] == ["p", "d2"]


def test_a_held_retired_worker_is_reaped_only_once_released():
    reg, _, _ = make({"p": LoadReport("prefill"), "d": LoadReport("decode")})
    asyncio.run(reg.poll_once())
    unhold = reg.hold("p", "d")
    reg.reconcile({"p": "prefill"})
    assert reg.reap() == [] and reg.get("d").holds == 1
    reg.mark_failed("d", "broke while retired")  # a running request may still blame it
    assert reg.get("d").last_error == "broke while retired"
    unhold()
    unhold()  # idempotent
    assert reg.get("p").holds == 0
    assert reg.reap() == ["d"]


def test_a_retired_worker_that_comes_back_keeps_its_row():
    reg, _, _ = make({"p": LoadReport("prefill"), "d": LoadReport("decode")})
    asyncio.run(reg.poll_once())
    unhold = reg.hold("d")
    reg.reconcile({"p": "prefill"})
    reg.reconcile({"p": "prefill", "d": "decode"})
    row = reg.get("d")
    assert row.holds == 1 and [w.address for w in reg.workers()] == ["p", "d"]
    assert not row.healthy  # it was not polled while retired: it must answer again
    asyncio.run(reg.poll_once())
    assert row.healthy
    unhold()
    assert reg.reap() == []  # listed again: nothing to reap


def test_reconcile_keeps_an_address_with_the_kind_it_has():
    reg, _, _ = make({"p": LoadReport("prefill"), "d": LoadReport("decode")})
    reg.reconcile({"p": "decode", "d": "decode"})
    assert reg.get("p").kind == "prefill"
    unhold = reg.hold("d")
    reg.reconcile({"p": "prefill"})
    reg.reconcile({"p": "prefill", "d": "prefill"})  # still held as a decode worker
    assert [w.address for w in reg.workers()] == ["p"] and reg.get("d").kind == "decode"
    unhold()
    assert reg.reap() == ["d"]
    reg.reconcile({"p": "prefill", "d": "prefill"})
    assert reg.get("d").kind == "prefill"
    with pytest.raises(ValueError):
        reg.reconcile({"x": "router"})


def test_router_flag_sets_the_misses_before_down():
    def config(*argv):
        return config_from_args(build_parser().parse_args(
            ["--prefill", "p:1", "--decode", "d:1", *argv]), {TOKEN_ENV: "t" * 32})

    assert config().registry.misses_before_down == RegistryConfig.misses_before_down
    assert config("--poll-misses", "1").registry.misses_before_down == 1
    with pytest.raises(ValueError, match="misses_before_down"):
        config("--poll-misses", "0")
