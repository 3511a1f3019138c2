"""Typed async calls to prefill and decode workers, each with a deadline.

This module and ``router/server.py`` are the only router modules that see protobuf: callers pass
and get the dataclasses below, and every failed call is raised as ``WorkerCallError`` carrying the
worker's address, the method and the gRPC status code, so the dispatcher can decide whom to blame.
Channels are cached per address and closed by ``close()``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.channels import ChannelSecurity, make_channel
from common.convert import (finish_reason_from_pb, load_report_from_pb, logprobs_from_pb,
                            request_spec_to_pb)
from common.load_report import LoadReport
from common.logprobs import TokenLogprobs
from common.pb.flashsplit.v1 import (decode_pb2, decode_pb2_grpc, prefill_pb2,
                                     prefill_pb2_grpc, types_pb2)
from common.request_spec import RequestSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientConfig:
    """Deadlines of the router's calls to workers, in seconds."""

    load_timeout_s: float = 1.0
    # A prefill answers after its handoff is acknowledged, so this covers queueing, the prompt's
    # forward passes and the transfer; a client deadline, when shorter, wins.
    prefill_timeout_s: float = 600.0
    # Streams run as long as generation does; this bounds a request whose client set no deadline.
    stream_timeout_s: float = 3600.0
    abort_timeout_s: float = 1.0


class WorkerCallError(Exception):
    """A call to a worker failed with a gRPC status."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} on {address}: {code.name}: {details}")
        self.address = address
        self.method = method
        self.code = code
        self.details = details


class WorkerTimeout(WorkerCallError, TimeoutError):
    """A call to a worker ran out of its deadline (DEADLINE_EXCEEDED): the worker may be alive
    and late, which the registry treats apart from a refusal."""


@dataclass(frozen=True)
class PrefillCall:
    """What the router asks of a prefill worker."""

    handoff_id: int
    spec: RequestSpec
    decode_address: str


@dataclass(frozen=True)
class PrefillResult:
    """A prefill worker's answer; finish_reason is set when the request ended at its first token."""

    first_token: int
    prompt_len: int
    queue_s: float = 0.0
    prefill_s: float = 0.0
    handoff_s: float = 0.0
    finish_reason: str | None = None
    first_logprobs: TokenLogprobs | None = None  # when the request asks for log-probabilities


@dataclass(frozen=True)
class EarlyToken:
    """The first token as the prefill worker sampled it, before its handoff was acknowledged."""

    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class TokenBatch:
    """One decode stream event: new tokens, and the finish reason on the last one; one
    ``logprobs`` entry per token when the request asks for them."""

    token_ids: tuple[int, ...]
    accept_lengths: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str = ""
    logprobs: tuple[TokenLogprobs, ...] = ()


def _logprobs(msg, field: str, address: str) -> TokenLogprobs | None:
    """``msg.field`` as log-probabilities, None when unset; a malformed one is the worker's
    error (INTERNAL)."""
    try:
        return logprobs_from_pb(getattr(msg, field)) if msg.HasField(field) else None
    except ValueError as exc:
        raise WorkerCallError(address, "Prefill.Prefill", grpc.StatusCode.INTERNAL,
                              str(exc)) from None


def _finish_reason(value: int) -> str | None:
    """None while unfinished; a value this build does not know counts as an error."""
    try:
        return finish_reason_from_pb(value) or None
    except ValueError:
        return "error"


def _error(exc: grpc.aio.AioRpcError, address: str, method: str) -> WorkerCallError:
    kind = WorkerTimeout if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else WorkerCallError
    return kind(address, method, exc.code(), exc.details() or "")


class DecodeStream:
    """The token stream of one request on one decode worker. Cancelling it aborts the request."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, address: str) -> None:
        self._call = call
        self.address = address

    def __aiter__(self) -> DecodeStream:
        return self

    async def __anext__(self) -> TokenBatch:
        batch = await self.read()
        if batch is None:
            raise StopAsyncIteration
        return batch

    async def read(self) -> TokenBatch | None:
        """The next event, or None when the stream ended. Cancelling a read cancels the call."""
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.address, "Decode.Stream") from None
        if msg is grpc.aio.EOF:
            return None
        if msg.logprobs and len(msg.logprobs) != len(msg.token_ids):
            raise WorkerCallError(self.address, "Decode.Stream", grpc.StatusCode.INTERNAL,
                                  f"{len(msg.logprobs)} log-probabilities for "
                                  f"{len(msg.token_ids)} tokens")
        try:
            logprobs = tuple(logprobs_from_pb(lp) for lp in msg.logprobs)
        except ValueError as exc:
            raise WorkerCallError(self.address, "Decode.Stream", grpc.StatusCode.INTERNAL,
                                  str(exc)) from None
        return TokenBatch(token_ids=tuple(msg.token_ids),
                          accept_lengths=tuple(msg.accept_lengths),
                          finish_reason=_finish_reason(msg.finish_reason),
                          error=msg.error, logprobs=logprobs)

    def cancel(self) -> None:
        self._call.cancel()


class WorkerClients:
    """Stubs for every worker address, over one cached channel per address; every call
    carries ``security``'s internal token (and TLS)."""

    def __init__(self, config: ClientConfig = ClientConfig(),
                 security: ChannelSecurity = ChannelSecurity()) -> None:
        self.config = config
        self.security = security
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            # NOTE: make_channel's options turn on keepalive pings (the workers' servers accept
            # them), so a stream to a host that vanished without closing its sockets fails
            # instead of hanging.
            channel = make_channel(address, self.security)
            self._channels[address] = channel
        return channel

    def _timeout(self, own: float, deadline_s: float | None) -> float:
        return own if deadline_s is None else max(min(own, deadline_s), 0.001)

    async def get_load(self, address: str, kind: str) -> LoadReport:
        """The worker's load report; WorkerCallError when it does not answer, or when its
        health service says NOT_SERVING (it is draining for a shutdown, or its engine died),
        so that the registry sends it no work however well its load looks."""
        ch = self._channel(address)
        stub = (prefill_pb2_grpc.PrefillStub(ch) if kind == "prefill"
                else decode_pb2_grpc.DecodeStub(ch))
        load, status = await asyncio.gather(
            stub.GetLoad(types_pb2.LoadRequest(), timeout=self.config.load_timeout_s),
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                 timeout=self.config.load_timeout_s),
            return_exceptions=True)
        if isinstance(load, grpc.aio.AioRpcError):
            raise _error(load, address, f"{kind}.GetLoad") from None
        if isinstance(load, BaseException):
            raise load
        # a worker without a health service (or one that fails the check) is judged by its
        # load report alone
        if (not isinstance(status, BaseException)
                and status.status != health_pb2.HealthCheckResponse.SERVING):
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
            raise WorkerCallError(address, "Health.Check", grpc.StatusCode.UNAVAILABLE,
                                  f"health is {name}")
        return load_report_from_pb(load)

    async def prefill(self, address: str, call: PrefillCall, deadline_s: float | None = None,
                      on_first_token: Callable[[EarlyToken], None] = lambda token: None
                      ) -> PrefillResult:
        """Run a prompt; returns once decode acknowledged the handoff (or the request ended).

        ``on_first_token`` gets the first token as soon as the worker has sampled it, before the
        handoff is acknowledged, when the request goes on past it."""
        stub = prefill_pb2_grpc.PrefillStub(self._channel(address))
        req = prefill_pb2.PrefillRequest(handoff_id=call.handoff_id,
                                         decode_address=call.decode_address,
                                         **request_spec_to_pb(call.spec))
        updates = stub.Prefill(req, timeout=self._timeout(self.config.prefill_timeout_s,
                                                          deadline_s))
        resp = None
        try:
            async for update in updates:
                if update.HasField("first_token"):
                    on_first_token(EarlyToken(
                        update.first_token.token_id,
                        _logprobs(update.first_token, "logprobs", address)))
                elif update.HasField("done"):
                    resp = update.done
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, address, "Prefill.Prefill") from None
        finally:
            updates.cancel()  # a no-op once the call ended; else the worker stops (we left)
        if resp is None:
            raise WorkerCallError(address, "Prefill.Prefill", grpc.StatusCode.INTERNAL,
                                  "the call ended without an outcome")
        t = resp.timings
        return PrefillResult(first_token=resp.first_token, prompt_len=resp.prompt_len,
                             queue_s=t.queue_s, prefill_s=t.prefill_s, handoff_s=t.handoff_s,
                             finish_reason=_finish_reason(resp.finish_reason),
                             first_logprobs=_logprobs(resp, "first_token_logprobs", address))

    def open_stream(self, address: str, handoff_id: int,
                    deadline_s: float | None = None) -> DecodeStream:
        """Start Decode.Stream; the call is under way when this returns (reads come later)."""
        stub = decode_pb2_grpc.DecodeStub(self._channel(address))
        call = stub.Stream(decode_pb2.StreamRequest(handoff_id=handoff_id),
                           timeout=self._timeout(self.config.stream_timeout_s, deadline_s))
        return DecodeStream(call, address)

    async def abort(self, address: str, kind: str, handoff_id: int, reason: str) -> bool:
        """Cancel a request on a worker; True when the worker still held it."""
        ch = self._channel(address)
        stub = (prefill_pb2_grpc.PrefillStub(ch) if kind == "prefill"
                else decode_pb2_grpc.DecodeStub(ch))
        try:
            resp = await stub.Abort(types_pb2.AbortRequest(handoff_id=handoff_id, reason=reason),
                                    timeout=self.config.abort_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, address, f"{kind}.Abort") from None
        return resp.found

    async def forget(self, address: str) -> None:
        """Close the channel to a worker the router no longer uses (nothing runs on it)."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)
