"""The live worker table: who is up, what each last reported, and when to try a down one again.

A background task asks every worker for its load (``GetLoad``) every ``poll_interval_s``. An
answer marks the worker healthy and stores the report; a failure (or the dispatcher's
``mark_failed``) marks it down, and a down worker is asked again only after an exponential backoff,
so a dead address costs one short timeout per backoff period instead of one per poll. A
healthy worker that only answers late (a poll that times out) stays in rotation until it has
missed ``misses_before_down`` polls in a row: a worker's event loop can wait seconds behind its
engine thread (a kernel compiling on first use holds the GIL), and one late answer would
otherwise fail every request dispatched meanwhile. An error answer (a refused connection,
NOT_SERVING) marks it down at once, as does the dispatcher's ``mark_failed``.

The registry holds no gRPC code: it is given a ``fetch_load(address, kind)`` coroutine (the
client's, or a fake in tests) and a clock, so backoff can be tested without sleeping.

The set of workers can change while the router runs (``router/discovery.py``: addresses behind a
DNS name): ``reconcile`` adds new addresses, which take requests once they answer a poll, and
retires vanished ones. A retired worker gets no new request and is no longer polled, but its row
stays (out of ``workers()``) while requests ``hold`` it, so that they finish on it; ``reap`` then
drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from common.load_report import WORKER_KINDS, LoadReport
from router.policy import WorkerView

log = logging.getLogger(__name__)

FetchLoad = Callable[[str, str], Awaitable[LoadReport]]


@dataclass(frozen=True)
class RegistryConfig:
    """How often workers are polled and how a down worker is retried."""

    poll_interval_s: float = 0.5
    # NOTE: the fetch_load coroutine applies the per-call deadline; this bounds it again so a
    # misbehaving fetcher cannot stall the whole poll round. 1 s proved too short for a worker
    # whose event loop shares a loaded 2-core host with a handoff (a live worker marked down).
    poll_timeout_s: float = 3.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    backoff_multiplier: float = 2.0
    # polls in a row a healthy worker may leave unanswered (timed out) before it counts as
    # down; SGLang's router waits for 3 failed health checks likewise
    misses_before_down: int = 3

    def __post_init__(self) -> None:
        if self.poll_interval_s <= 0 or self.poll_timeout_s <= 0:
            raise ValueError("poll_interval_s and poll_timeout_s must be > 0")
        if self.misses_before_down < 1:
            raise ValueError("misses_before_down must be >= 1")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.backoff_multiplier < 1:
            raise ValueError("backoff_multiplier must be >= 1")


def backoff_delay(config: RegistryConfig, consecutive_failures: int) -> float:
    """Seconds to wait before asking a worker again after its n-th consecutive failure."""
    n = max(consecutive_failures, 1)
    delay = config.backoff_initial_s * config.backoff_multiplier ** (n - 1)
    return min(config.backoff_max_s, delay)


@dataclass
class WorkerState:
    """One row of the table. Mutated only on the event loop, so no lock is needed.

    healthy starts False: a worker takes requests only after it has answered once.
    in_flight is the router's own count of assignments the load report cannot show yet; holds
    counts requests using the worker at all (from choice to their last call to it).
    """

    address: str
    kind: str
    healthy: bool = False
    load: LoadReport | None = None
    consecutive_failures: int = 0
    missed_polls: int = 0  # polls in a row that timed out while healthy
    next_retry_at: float = 0.0
    failed_at: float | None = None
    last_error: str = ""
    in_flight: int = 0
    holds: int = 0

    def view(self) -> WorkerView:
        load = self.load
        return WorkerView(
            address=self.address, kind=self.kind, healthy=self.healthy,
            fingerprint=load.model_fingerprint if load else "",
            queue_len=load.queue_len if load else 0,
            free_slots=load.free_slots if load else 0,
            free_pages=load.free_pages if load else 0,
            in_flight=self.in_flight)


class WorkerRegistry:
    """The prefill and decode workers the router knows, keyed by address."""

    def __init__(self, workers: Iterable[tuple[str, str]], fetch_load: FetchLoad,
                 config: RegistryConfig = RegistryConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._fetch_load = fetch_load
        self._clock = clock
        self._workers: dict[str, WorkerState] = {}
        for address, kind in workers:
            if kind not in WORKER_KINDS:
                raise ValueError(f"worker kind must be one of {WORKER_KINDS}, got {kind!r}")
            if address in self._workers:
                raise ValueError(f"worker address {address} is listed twice")
            self._workers[address] = WorkerState(address=address, kind=kind)
        # workers no longer listed whose rows requests still hold (see the module docstring)
        self._retired: dict[str, WorkerState] = {}
        self._task: asyncio.Task | None = None

    # -- reading ------------------------------------------------------------------------------

    def workers(self) -> list[WorkerState]:
        """All rows, prefill first, then decode, each in address order."""
        order = {k: i for i, k in enumerate(WORKER_KINDS)}
        return sorted(self._workers.values(), key=lambda w: (order[w.kind], w.address))

    def get(self, address: str) -> WorkerState:
        """The row of a listed or retired worker; KeyError for any other address."""
        if address in self._workers:
            return self._workers[address]
        return self._retired[address]

    def _find(self, address: str) -> WorkerState | None:
        # NOTE: answers and failures may arrive for a worker reaped meanwhile; they are dropped
        return self._workers.get(address) or self._retired.get(address)

    def views(self) -> list[WorkerView]:
        return [w.view() for w in self.workers()]

    def fingerprint(self) -> str:
        """The model fingerprint some healthy worker reports, or "" when none has."""
        for w in self.workers():
            if w.healthy and w.load and w.load.model_fingerprint:
                return w.load.model_fingerprint
        return ""

    # -- updates ------------------------------------------------------------------------------

    def record_success(self, address: str, report: LoadReport,
                       asked_at: float | None = None) -> None:
        """Store a report; ``asked_at`` is when it was asked for (default: now)."""
        w = self._find(address)
        if w is None:
            return
        if w.failed_at is not None and asked_at is not None and asked_at <= w.failed_at:
            # NOTE: the question went out before the failure was recorded (a poll overlapping
            # mark_failed): the answer says nothing about the worker since, so it cannot
            # bring the worker back early.
            return
        if report.kind != w.kind:
            self.record_failure(address, f"reports itself as a {report.kind} worker, "
                                         f"configured as {w.kind}")
            return
        if not w.healthy:
            log.info("%s worker %s is up", w.kind, address)
        w.healthy = True
        w.load = report
        w.consecutive_failures = 0
        w.missed_polls = 0
        w.last_error = ""

    def record_failure(self, address: str, error: str) -> None:
        w = self._find(address)
        if w is None:
            return
        w.consecutive_failures += 1
        w.last_error = error
        w.failed_at = self._clock()
        delay = backoff_delay(self.config, w.consecutive_failures)
        w.next_retry_at = self._clock() + delay
        if w.healthy:
            log.warning("%s worker %s is down: %s", w.kind, address, error)
        w.healthy = False
        log.debug("%s worker %s: failure %d, next try in %.2f s", w.kind, address,
                  w.consecutive_failures, delay)

    def record_miss(self, address: str, error: str) -> None:
        """A poll that timed out: a healthy worker stays in rotation (on its last report) until
        ``misses_before_down`` in a row; a down one stays down and backs off further."""
        w = self._find(address)
        if w is None:
            return
        if w.healthy and w.missed_polls + 1 < self.config.misses_before_down:
            w.missed_polls += 1
            log.info("%s worker %s answered no poll in time (%d of %d before it counts as "
                     "down): %s", w.kind, address, w.missed_polls,
                     self.config.misses_before_down, error)
            return
        self.record_failure(address, error)

    def mark_failed(self, address: str, error: str) -> None:
        """Take a worker out of rotation after a failed call; the poller brings it back."""
        self.record_failure(address, error)

    def note_full(self, address: str) -> None:
        """A decode worker refused a handoff for lack of room: treat it as full until it reports.

        It is not down, so it is not backed off; it just stops winning choices on a stale report.
        """
        w = self._find(address)
        if w is not None and w.load is not None:
            w.load = dataclasses.replace(w.load, free_slots=0, free_pages=0)

    def assign(self, *addresses: str) -> Callable[[], None]:
        """Count a request against these workers' in_flight; call the result once to uncount it.

        The dispatcher releases when the prefill call returns: by then the prefill worker's queue
        and the decode worker's pools (the handoff was admitted or refused) show the request.
        """
        return self._count(addresses, "in_flight")

    def hold(self, *addresses: str) -> Callable[[], None]:
        """Count a request's use of these workers; call the result once, after its last call to
        them. A retired worker is reaped only when nothing holds it."""
        return self._count(addresses, "holds")

    def _count(self, addresses: tuple[str, ...], counter: str) -> Callable[[], None]:
        rows = [self.get(a) for a in addresses]
        for w in rows:
            setattr(w, counter, getattr(w, counter) + 1)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                for w in rows:
                    setattr(w, counter, getattr(w, counter) - 1)
        return release

    # -- membership ---------------------------------------------------------------------------

    def reconcile(self, wanted: Mapping[str, str]) -> None:
        """Make the listed workers ``wanted`` (address -> kind): add the new ones, retire the
        rest. A new worker, or a retired one that comes back (with its row, so the requests that
        hold it are still counted), takes requests only once it has answered a poll."""
        wrong = sorted({k for k in wanted.values() if k not in WORKER_KINDS})
        if wrong:
            raise ValueError(f"worker kind must be one of {WORKER_KINDS}, got {wrong}")
        for address, kind in wanted.items():
            listed = self._workers.get(address)
            if listed is not None:
                if listed.kind != kind:
                    log.warning("%s is listed as a %s worker; not adding it as a %s worker",
                                address, listed.kind, kind)
                continue
            row = self._retired.pop(address, None)
            if row is not None and row.kind != kind:
                # the address now serves the other kind: the old row stays until it is reaped
                self._retired[address] = row
                log.warning("%s was a %s worker and still has requests; not adding it as a %s "
                            "worker until they end", address, row.kind, kind)
                continue
            if row is not None:
                # it was not polled while retired: what it last said may be stale
                row.healthy, row.next_retry_at = False, 0.0
            self._workers[address] = row or WorkerState(address=address, kind=kind)
            log.info("%s worker %s added", kind, address)
        for address in [a for a in self._workers if a not in wanted]:
            row = self._workers.pop(address)
            self._retired[address] = row
            log.info("%s worker %s removed: it takes no new request (%d running)", row.kind,
                     address, row.holds)

    def reap(self) -> list[str]:
        """Drop the retired workers no request holds; their addresses (to close channels)."""
        gone = [a for a, w in self._retired.items() if w.holds <= 0]
        for address in gone:
            del self._retired[address]
        return gone

    # -- polling ------------------------------------------------------------------------------

    def due(self) -> list[WorkerState]:
        """Workers to ask now: every healthy one, and down ones whose backoff has expired."""
        now = self._clock()
        return [w for w in self.workers() if w.healthy or now >= w.next_retry_at]

    async def poll_once(self) -> None:
        """Ask every due worker for its load, concurrently, and record the outcomes."""
        # NOTE: the time of asking is taken with the list of due workers, not when each poll
        # task first runs: a failure recorded in between (the dispatcher's mark_failed) must
        # make the answer stale, or a worker marked down would come straight back.
        asked_at = self._clock()
        await asyncio.gather(*(self._poll(w, asked_at) for w in self.due()))

    async def _poll(self, w: WorkerState, asked_at: float) -> None:
        try:
            report = await asyncio.wait_for(self._fetch_load(w.address, w.kind),
                                            self.config.poll_timeout_s)
        except asyncio.CancelledError:
            raise
        except TimeoutError as exc:  # ours, or the call's own deadline (a late answer)
            self.record_miss(w.address, str(exc)
                             or f"no load report within {self.config.poll_timeout_s} s")
        except Exception as exc:  # any failure to answer means down; the reason is kept
            self.record_failure(w.address, str(exc) or type(exc).__name__)
        else:
            self.record_success(w.address, report, asked_at)

    async def _run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.config.poll_interval_s)

    async def start(self) -> None:
        """Poll once (so workers that are already up take requests at once), then keep polling."""
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="worker-registry-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
