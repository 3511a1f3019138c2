"""Mutual TLS on every port and an API key on the public one, end to end, with real processes.

The test makes its own CA and certificates. Every process serves TLS and requires a client
certificate from that CA; the router and the prefill worker present theirs when they call the
workers, so an answer from the router proves router -> prefill -> decode all ran over mTLS with
the internal token.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.auth import write_secret_file
from common.channels import ChannelSecurity, make_channel
from common.healthcheck import check
from common.model.load import load_model
from common.pb.flashsplit.v1 import decode_pb2_grpc, types_pb2
from common.sampling import SamplingParams
from common.security import API_KEY_ENV
from common.tokenizer import ByteTokenizer
from common.tls import TlsFiles
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.router.test_end_to_end import WORKER_ARGS, local_greedy
from tests.tls_certs import make_pki

API_KEY = "sk-flashsplit-test"
PROMPTS = [[9, 8, 7], [(5 * j) % 256 for j in range(13)]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(pki, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-key"
    write_secret_file(key_file, API_KEY)
    tls = ("--tls-cert", pki.server.cert, "--tls-key", pki.server.key, "--tls-ca", pki.ca)
    config = ClusterConfig(model="tiny", worker_args=WORKER_ARGS + tls,
                           router_args=tls + ("--api-key-file", str(key_file)), metrics=True,
                           router_http_port=0)
    with Cluster(config) as cluster:
        yield cluster


def client(pki, *, api_key: str | None = API_KEY, cert: bool = True) -> ChannelSecurity:
    tls = TlsFiles.load(pki.client.cert if cert else None, pki.client.key if cert else None,
                        pki.ca)
    return ChannelSecurity.public(api_key, tls)


def run_prompts(cluster, security: ChannelSecurity):
    async def all_of_them():
        return await asyncio.gather(*[
            generate(cluster.router_address, request_to_pb(token_ids=p, params=GREEDY),
                     timeout_s=30, security=security) for p in PROMPTS])

    return asyncio.run(asyncio.wait_for(all_of_them(), 60))


def test_generation_over_mutual_tls_is_exact(cluster, pki):
    outs = run_prompts(cluster, client(pki))
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS, GREEDY)


@pytest.mark.parametrize("case", ["plaintext", "no_client_cert", "stranger_cert", "no_api_key",
                                  "wrong_api_key"])
def test_the_public_port_refuses_what_it_does_not_trust(cluster, pki, case):
    security = {
        "plaintext": ChannelSecurity.public(API_KEY),
        "no_client_cert": client(pki, cert=False),
        "stranger_cert": ChannelSecurity.public(API_KEY, TlsFiles.load(
            pki.stranger.cert, pki.stranger.key, pki.ca)),
        "no_api_key": client(pki, api_key=None),
        "wrong_api_key": client(pki, api_key="sk-guess"),
    }[case]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run_prompts(cluster, security)
    expected = (grpc.StatusCode.UNAUTHENTICATED if case.endswith("api_key")
                else grpc.StatusCode.UNAVAILABLE)  # the handshake fails: no call is made
    assert err.value.code() == expected


def test_workers_need_a_certificate_and_the_token(cluster, pki):
    decode = next(w for w in cluster.workers if w.kind == "decode")
    certified = TlsFiles.load(pki.client.cert, pki.client.key, pki.ca)

    async def get_load(security: ChannelSecurity) -> grpc.StatusCode:
        async with make_channel(decode.address, security) as channel:
            try:
                await decode_pb2_grpc.DecodeStub(channel).GetLoad(types_pb2.LoadRequest(),
                                                                  timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    async def scenario():
        token = cluster.internal_token
        assert await get_load(ChannelSecurity.internal(token)) == grpc.StatusCode.UNAVAILABLE
        no_cert = TlsFiles.load(None, None, pki.ca)
        assert await get_load(ChannelSecurity.internal(token, no_cert)) == \
            grpc.StatusCode.UNAVAILABLE
        assert await get_load(ChannelSecurity(tls=certified)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert await get_load(ChannelSecurity.internal(token, certified)) == grpc.StatusCode.OK

    asyncio.run(asyncio.wait_for(scenario(), 60))
    # the compose-style probe works on a TLS port when it is given the CA and a certificate
    assert check(decode.address, tls=certified)
    assert not check(decode.address)


def test_every_metrics_port_serves_https_to_a_scraper_with_a_certificate(cluster, pki):
    run_prompts(cluster, client(pki))
    for proc in [*cluster.workers, cluster.router]:
        # the router's are on its HTTP API, which serves TLS as its gRPC port does
        url = proc.metrics_url
        assert url.startswith("https://"), url
        trusted = ssl.create_default_context(cafile=pki.ca)
        trusted.load_cert_chain(pki.client.cert, pki.client.key)
        with urllib.request.urlopen(url, context=trusted, timeout=10) as reply:
            names = {f.name for f in text_string_to_metric_families(reply.read().decode())}
        assert any(n.startswith("flashsplit_") for n in names), (proc.name, names)
        anonymous = ssl.create_default_context(cafile=pki.ca)  # no client certificate
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, context=anonymous, timeout=10).read()


def test_the_http_api_serves_https_with_the_key_and_a_client_certificate(cluster, pki):
    assert cluster.http_url.startswith("https://")
    url = f"{cluster.http_url}/v1/completions"
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10,
                       "temperature": 0, "ignore_eos": True}).encode()

    def post(cert: bool, key: str | None = API_KEY):
        context = ssl.create_default_context(cafile=pki.ca)
        if cert:
            context.load_cert_chain(pki.client.cert, pki.client.key)
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        request = urllib.request.Request(url, data=body, headers=headers)
        with urllib.request.urlopen(request, context=context, timeout=30) as reply:
            return json.loads(reply.read())

    (greedy,) = local_greedy(load_model("tiny"), PROMPTS[:1], GREEDY)
    answer = post(cert=True)
    assert answer["choices"][0]["text"] == ByteTokenizer().decode(greedy)
    assert answer["usage"]["completion_tokens"] == len(greedy)
    with pytest.raises(urllib.error.HTTPError) as no_key:
        post(cert=True, key=None)
    assert no_key.value.code == 401
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        post(cert=False)


def test_generate_cli_with_tls_and_api_key(cluster, pki):
    base = [sys.executable, "-m", "router.cli", "generate", "--router", cluster.router_address,
            "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "10",
            "--temperature", "0", "--ignore-eos", "--json", "--tls-ca", pki.ca,
            "--tls-cert", pki.client.cert, "--tls-key", pki.client.key]
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    done = subprocess.run(base, capture_output=True, text=True, timeout=60,
                          env={**env, API_KEY_ENV: API_KEY})
    assert done.returncode == 0, done.stderr
    expected = local_greedy(load_model("tiny"), PROMPTS[:1], GREEDY)[0]
    assert json.loads(done.stdout)["token_ids"] == expected
    done = subprocess.run(base + ["--api-key", "sk-wrong"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr


@pytest.mark.parametrize("case", ["tcp", "per-rank streams"])
def test_handoff_bytes_over_tcp_go_inside_tls(pki, tmp_path, case):
    """With TLS on the internal ports the state's TCP connections are TLS too (the ``tcp``
    transport, and tensor-parallel workers' per-rank streams, each rank with its own
    connections), and the tokens are exact with the pools full after."""
    from tests.router.test_end_to_end import wait_all_free

    key_file = tmp_path / "api-key"
    write_secret_file(key_file, API_KEY)
    tls = ("--tls-cert", pki.server.cert, "--tls-key", pki.server.key, "--tls-ca", pki.ca)
    extra, tp = (("--handoff-transport", "tcp"), 1) if case == "tcp" else \
        (("--tp-handoff", "ranks"), 2)
    config = ClusterConfig(model="tiny", worker_args=WORKER_ARGS + tls + extra,
                           router_args=tls + ("--api-key-file", str(key_file)),
                           prefill_tp=tp, decode_tp=tp)
    with Cluster(config) as cluster:
        outs = run_prompts(cluster, client(pki))
        reports = asyncio.run(wait_all_free(
            cluster, tls=TlsFiles.load(pki.client.cert, pki.client.key, pki.ca)))
        logs = {w.kind: w.stderr_tail(200) for w in cluster.workers}
    assert [o.token_ids for o in outs] == local_greedy(load_model("tiny"), PROMPTS, GREEDY)
    assert all(r.free_pages == r.total_pages and r.free_slots == r.total_slots for r in reports)
    assert "handoff chunks over TCP: listening" in logs["decode"]
    if case == "per-rank streams":
        assert logs["prefill"].count("over per-rank streams (2 -> 2 ranks)") == len(PROMPTS)
    assert "TLS handshake failed" not in logs["decode"]
