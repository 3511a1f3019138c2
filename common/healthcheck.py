"""``python -m common.healthcheck HOST:PORT [SERVICE]``: exit 0 iff the server reports SERVING.

What compose health checks run (the images carry no grpc_health_probe binary).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m common.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    return 0 if check(*args) else 1


if __name__ == "__main__":
    sys.exit(main())
