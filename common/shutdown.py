"""Graceful shutdown of a gRPC server: stop taking calls, give running ones a grace period, then
end the rest with a status that says the server is shutting down.

``stop_gracefully`` runs the sequence, on SIGTERM or SIGINT (``serve_until_signal``) or when a
router stops:

1. health says NOT_SERVING and the server takes no new call (gRPC answers UNAVAILABLE), so the
   router and ``flashsplit up`` stop sending work here; running calls go on;
2. after ``grace`` seconds, ``expired`` is set, and the calls that asked for it
   (``cancelled_at_expiry``) are cancelled: such a servicer catches the CancelledError and,
   seeing ``expired`` set, ends its call with a proper last message (the router's ``Generate``
   sends finish reason ABORT, a decode worker's ``Stream`` an ABORT event);
3. ``final_s`` later, every call still running is cancelled by the ``interceptor()`` of this
   object, which ends it with UNAVAILABLE "<server> shutting down" instead of gRPC's own
   "Cancelling all calls"; gRPC's hard stop comes a moment after that, as a last resort.

A server whose calls all end within the grace stops at once, without waiting it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any, Awaitable, Callable

import grpc

from common.rpc_wrap import Behavior, rewrap

log = logging.getLogger(__name__)

# between our own cancellation of the last calls and gRPC's, so that ours always comes first
_HARD_STOP_MARGIN_S = 1.0


class GracefulShutdown:
    """The shutdown state of one server, shared by its servicers and its interceptor.

    ``name`` says what is shutting down in every status it sends ("decode worker", "router").
    """

    def __init__(self, name: str, final_s: float = 1.0) -> None:
        if final_s < 0:
            raise ValueError(f"final_s must be >= 0, got {final_s}")
        self.name = name
        self.final_s = final_s
        self.expired = asyncio.Event()
        self._cut = False
        self._cut_event = asyncio.Event()
        # running calls, each with whether it may be cancelled now: a streaming call is not
        # while gRPC writes its message (a cancellation there ends it CANCELLED, bypassing us)
        self._calls: dict[asyncio.Task, bool] = {}
        self._graceful: set[asyncio.Task] = set()
        # graceful streaming calls the expiry found writing a message: cancelled inside their
        # behaviour as soon as the write returns
        self._expire_on_resume: set[asyncio.Task] = set()

    @property
    def message(self) -> str:
        return f"{self.name} shutting down"

    @contextlib.contextmanager
    def cancelled_at_expiry(self) -> Iterator[None]:
        """While inside, the current task is cancelled when the grace is over.

        The caller tells that cancellation from a client's by ``expired.is_set()``; it costs
        nothing per message, unlike racing each wait against the expiry.
        """
        task = asyncio.current_task()
        self._graceful.add(task)
        try:
            if self.expired.is_set():
                task.cancel()
            yield
        finally:
            self._graceful.discard(task)

    def _expire(self) -> None:
        self.expired.set()
        for task in list(self._graceful):
            if self._calls.get(task, True):
                task.cancel()
            else:  # cancelling it inside gRPC's write would end it CANCELLED, not gracefully
                self._expire_on_resume.add(task)

    def _cancel_calls(self) -> int:
        """Cancel every running call that is inside its behaviour; a streaming call now writing
        a message ends with the same status as soon as the write returns."""
        self._cut = True
        self._cut_event.set()
        for task, cancellable in self._calls.items():
            if cancellable:
                task.cancel()
        return len(self._calls)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """The interceptor that ends calls still running after ``final_s`` with UNAVAILABLE."""
        return _ShutdownInterceptor(self)

    def _wrap(self, behavior: Behavior, response_streaming: bool) -> Behavior:
        calls = self._calls

        async def abort_if_cut(context: grpc.aio.ServicerContext) -> None:
            if self._cut:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.message)

        # a streaming behaviour written as a coroutine (context.write) is wrapped as one too
        if response_streaming and not inspect.iscoroutinefunction(behavior):
            async def streaming(request, context):
                task = asyncio.current_task()
                items = behavior(request, context).__aiter__()
                try:
                    while True:
                        await abort_if_cut(context)  # cut while the last message was written
                        calls[task] = True
                        try:
                            if task in self._expire_on_resume:
                                # the grace ended while the last message was written: the
                                # cancellation lands where the behaviour waits for it
                                self._expire_on_resume.discard(task)
                                item = await items.athrow(asyncio.CancelledError())
                            else:
                                item = await items.__anext__()
                        except StopAsyncIteration:
                            return
                        except asyncio.CancelledError:
                            await abort_if_cut(context)
                            raise
                        calls[task] = False  # gRPC writes it now: not to be cancelled there
                        yield item
                finally:
                    calls.pop(task, None)
                    self._expire_on_resume.discard(task)
                    await items.aclose()
            return streaming

        async def unary(request, context):
            # the behaviour runs as a task of its own, so that a cut cancels it and not the
            # call's task: that one then sends our status with no cancellation pending on it
            # (a cancelled call task's status can be lost to gRPC's CANCELLED)
            inner = asyncio.ensure_future(behavior(request, context))
            cut = asyncio.ensure_future(self._cut_event.wait())
            calls[inner] = True
            try:
                await asyncio.wait({inner, cut}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the client went away, or gRPC's hard stop
                inner.cancel()
                raise
            finally:
                cut.cancel()
                calls.pop(inner, None)
            if not inner.done():
                inner.cancel()
                await asyncio.gather(inner, return_exceptions=True)
            if inner.cancelled():
                await abort_if_cut(context)
            return inner.result()
        return unary


class _ShutdownInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, shutdown: GracefulShutdown) -> None:
        self._shutdown = shutdown

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        streaming = bool(handler.response_streaming)
        return rewrap(handler, lambda b: self._shutdown._wrap(b, streaming))


async def stop_gracefully(server: grpc.aio.Server, health: Any, shutdown: GracefulShutdown,
                          grace: float) -> None:
    """Run the module docstring's sequence; returns once the server has stopped."""
    if grace < 0:
        raise ValueError(f"grace must be >= 0, got {grace}")
    if health is not None:
        await health.enter_graceful_shutdown()
    stop = asyncio.ensure_future(
        server.stop(grace + shutdown.final_s + _HARD_STOP_MARGIN_S))
    done, _ = await asyncio.wait({stop}, timeout=grace)
    if not done:
        log.info("%s: grace of %.1f s is over; ending the calls still running", shutdown.name,
                 grace)
        shutdown._expire()
        done, _ = await asyncio.wait({stop}, timeout=shutdown.final_s)
    if not done:
        n = shutdown._cancel_calls()
        log.info("%s: cancelled %d calls", shutdown.name, n)
    await stop
