"""Where the router's workers are: fixed addresses, and DNS names resolved again while it runs.

``--prefill`` and ``--decode`` take ``host:port`` (one worker for the router's lifetime) or
``dns:///name:port`` (gRPC's target syntax: every address ``name`` resolves to, on ``port``).
Every ``interval_s`` the names are resolved again and the registry is reconciled with the answers
(``WorkerRegistry.reconcile``): a new address is added and takes requests once it has answered a
load poll with its health SERVING; an address that is gone is retired, so it gets no new request
while the requests it runs finish on their open channel, and once none holds it, it is dropped and
its channel closed (``on_removed``). So scaling a Kubernetes Deployment behind a headless Service
adds or removes workers without restarting the router.

A resolution that fails (no answer from DNS, a timeout) keeps the name's last answer: a DNS hiccup
must not empty the fleet. A name that does not exist or has no address is an empty answer: that is
what a headless Service with no ready pod returns.

Resolution goes through a ``Resolver`` (``SystemResolver``: ``getaddrinfo`` on a worker thread, so
a slow DNS server never blocks the event loop), so tests can add and remove addresses without DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from common.load_report import WORKER_KINDS
from router.registry import WorkerRegistry

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
# getaddrinfo's answers for "this name has no address", as opposed to "could not ask"
_NO_ADDRESS = frozenset(getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA")
                        if hasattr(socket, name))


@dataclass(frozen=True)
class DiscoveryConfig:
    """How often DNS names given as worker targets are resolved again, in seconds."""

    interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"the discovery interval must be > 0 seconds, got {self.interval_s}")


@dataclass(frozen=True)
class WorkerTarget:
    """One ``--prefill`` / ``--decode`` value: a fixed address, or a DNS name and a port."""

    kind: str
    host: str
    port: int
    dns: bool = False

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def __str__(self) -> str:
        return (DNS_SCHEME if self.dns else "") + self.address


def format_address(host: str, port: int) -> str:
    """host:port, with an IPv6 address in brackets as gRPC targets write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_target(text: str, kind: str) -> WorkerTarget:
    """``host:port``, ``[v6]:port`` or ``dns:///name:port``; ValueError on anything else."""
    if kind not in WORKER_KINDS:
        raise ValueError(f"worker kind must be one of {WORKER_KINDS}, got {kind!r}")
    dns = text.startswith(DNS_SCHEME)
    rest = text[len(DNS_SCHEME):] if dns else text
    if rest.startswith("//") or (not dns and text.startswith("dns:")):
        raise ValueError(f"{kind} target {text!r}: write a DNS name as dns:///NAME:PORT "
                         f"(a DNS server of its own cannot be given)")
    host, sep, port_text = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{kind} target {text!r} is not HOST:PORT or dns:///NAME:PORT "
                         f"(a port from 1 to 65535 is needed)")
    return WorkerTarget(kind=kind, host=host, port=int(port_text), dns=dns)


def parse_targets(prefill: Sequence[str], decode: Sequence[str]) -> list[WorkerTarget]:
    """Every target, prefill first; ValueError when a fixed address is listed twice."""
    targets = ([parse_target(t, "prefill") for t in prefill]
               + [parse_target(t, "decode") for t in decode])
    fixed = [t.address for t in targets if not t.dns]
    twice = sorted({a for a in fixed if fixed.count(a) > 1})
    if twice:
        raise ValueError(f"worker address {', '.join(twice)} is listed twice")
    return targets


class Resolver(Protocol):
    """Turns a DNS name into worker addresses."""

    async def resolve(self, host: str, port: int) -> Sequence[str]:
        """The addresses (``format_address``) that ``host`` on ``port`` stands for, [] when it
        has none; OSError when DNS could not be asked."""


class SystemResolver:
    """The host's resolver (``/etc/resolv.conf``, so a pod's search domains apply)."""

    async def resolve(self, host: str, port: int) -> Sequence[str]:
        try:
            infos = await asyncio.to_thread(socket.getaddrinfo, host, port,
                                            type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in _NO_ADDRESS:
                return []
            raise
        return sorted({format_address(info[4][0], port) for info in infos})


class WorkerDiscovery:
    """Keeps ``registry``'s workers equal to what ``targets`` stand for (module docstring)."""

    def __init__(self, targets: Sequence[WorkerTarget], registry: WorkerRegistry,
                 resolver: Resolver, config: DiscoveryConfig = DiscoveryConfig(), *,
                 on_removed: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.targets = tuple(targets)
        self.registry = registry
        self.resolver = resolver
        self.config = config
        self._on_removed = on_removed
        # each name's last answer, kept when a later resolution fails
        self._answers: dict[WorkerTarget, tuple[str, ...]] = {}
        self._task: asyncio.Task | None = None

    @staticmethod
    def fixed_workers(targets: Sequence[WorkerTarget]) -> list[tuple[str, str]]:
        """(address, kind) of the fixed targets: the registry's workers before any resolution."""
        return [(t.address, t.kind) for t in targets if not t.dns]

    @property
    def resolves(self) -> bool:
        """Whether any target is a DNS name (else there is nothing to refresh)."""
        return any(t.dns for t in self.targets)

    async def _resolve(self, target: WorkerTarget) -> None:
        try:
            found = tuple(await self.resolver.resolve(target.host, target.port))
        except OSError as exc:
            kept = self._answers.get(target, ())
            log.warning("could not resolve %s %s (%s); keeping its %d known address(es)",
                        target.kind, target, exc, len(kept))
            return
        if found != self._answers.get(target):
            log.info("%s %s resolves to %s", target.kind, target, ", ".join(found) or "nothing")
        self._answers[target] = found

    async def refresh(self) -> None:
        """Resolve every name once and reconcile the registry with the answers."""
        # NOTE: reaped before reconciling, so a worker retired now is dropped one refresh later
        # at the earliest: a load poll already under way when it was retired has ended by then
        # and cannot open its channel again after it was closed.
        for address in self.registry.reap():
            if self._on_removed is not None:
                await self._on_removed(address)
        names = [t for t in self.targets if t.dns]
        await asyncio.gather(*(self._resolve(t) for t in names))
        wanted: dict[str, str] = {}
        for target in self.targets:
            addresses = self._answers.get(target, ()) if target.dns else (target.address,)
            for address in addresses:
                kind = wanted.setdefault(address, target.kind)
                if kind != target.kind:
                    log.warning("%s (from %s %s) is already a %s worker; not using it as a %s "
                                "worker too", address, target.kind, target, kind, target.kind)
        self.registry.reconcile(wanted)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end discovery for the router's lifetime
                log.exception("worker discovery failed; trying again in %.1f s",
                              self.config.interval_s)

    async def start(self) -> None:
        """Resolve once (so the first load poll sees the workers), then keep resolving."""
        if not self.resolves:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="worker-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
