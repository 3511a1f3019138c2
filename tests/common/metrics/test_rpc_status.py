"""answered_status: the status a real gRPC caller sees is the one recorded."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.metrics.rpc_status import answered_status


class Recorded(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.statuses: list[str] = []

    @answered_status(lambda self, status: self.statuses.append(status))
    async def Check(self, request, context):
        if request.service == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such service")
        if request.service == "slow":
            await asyncio.sleep(10)
        if request.service == "bug":
            raise RuntimeError("a bug")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_ok_aborts_cancellations_and_bugs_are_recorded_as_the_caller_sees_them():
    servicer = Recorded()

    async def scenario() -> list[grpc.StatusCode]:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service, timeout in (("", 5), ("invalid", 5), ("slow", 0.2), ("bug", 5)):
                    try:
                        await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                         timeout=timeout)
                        seen.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        seen.append(exc.code())
            for _ in range(100):  # the cancelled handler ends shortly after its caller
                if len(servicer.statuses) == 4:
                    break
                await asyncio.sleep(0.01)
        finally:
            await server.stop(0)
        return seen

    seen = asyncio.run(scenario())
    assert seen == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN]
    # a deadline reaches the handler as a cancellation (whenever the server notices it)
    assert sorted(servicer.statuses) == sorted(["OK", "INVALID_ARGUMENT", "CANCELLED",
                                                "UNKNOWN"])
