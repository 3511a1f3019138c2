"""``python -m common.healthcheck HOST:PORT [SERVICE] [--tls-ca PEM [--tls-cert PEM --tls-key PEM]]``:
exit 0 iff the server reports SERVING.

What compose health checks run (the images carry no grpc_health_probe binary). Health needs no
token or API key; on a TLS port give the CA (and, under mutual TLS, a client certificate).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.tls import TlsFiles


def check(address: str, service: str = "", timeout_s: float = 2.0,
          tls: TlsFiles | None = None) -> bool:
    channel = (grpc.insecure_channel(address) if tls is None
               else grpc.secure_channel(address, tls.channel_credentials()))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m common.healthcheck", description=__doc__)
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("service", nargs="?", default="")
    p.add_argument("--tls-ca", default=None, help="CA that signed the server's certificate")
    p.add_argument("--tls-cert", default=None, help="client certificate, for mutual TLS")
    p.add_argument("--tls-key", default=None, help="its key")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        tls = TlsFiles.load(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if check(args.address, args.service, tls=tls) else 1


if __name__ == "__main__":
    sys.exit(main())
