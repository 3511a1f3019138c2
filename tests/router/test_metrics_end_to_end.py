"""Metrics and logs of a real cluster (router, prefill and decode processes, the built-in model
and draft): every endpoint is scraped before and after a few requests and parsed with
prometheus_client's parser; the counts move by what was served, and the pools end full. The
processes log JSON, and one request's id is on its lines in all three."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from common.sampling import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.common.metrics.scrape import Scrape, scrape_url
from tests.router.test_end_to_end import worker_load

WORKER_ARGS = ("--page-size", "4", "--num-pages", "256", "--num-slots", "16",
               "--draft", "tiny", "--block-size", "4", "--handoff-transport", "stream")
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 256 for j in range(3 + 4 * i)] for i in range(4)]
R, P, D = "flashsplit_router", "flashsplit_prefill", "flashsplit_decode"


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(model="tiny", worker_args=WORKER_ARGS, metrics=True,
                           log_format="json", router_http_port=0,
                           router_args=("--metrics-port", "0", "--poll-interval", "0.1"),
                           start_timeout_s=180)
    with Cluster(config) as c:
        yield c


def worker(cluster, kind: str):
    return next(w for w in cluster.workers if w.kind == kind)


def scrape_all(cluster) -> dict[str, Scrape]:
    return {"router": scrape_url(cluster.router.metrics_url),
            "router_http": scrape_url(cluster.http_url + "/metrics"),
            "prefill": scrape_url(worker(cluster, "prefill").metrics_url),
            "decode": scrape_url(worker(cluster, "decode").metrics_url)}


def pools_full(s: Scrape, prefix: str) -> bool:
    return (s.value(f"{prefix}_kv_pages_free") == s.value(f"{prefix}_kv_pages_capacity") > 0
            and s.value(f"{prefix}_state_slots_free") == s.value(f"{prefix}_state_slots_capacity")
            and s.value(f"{prefix}_running_requests") == 0)


def idle_scrapes(cluster, timeout_s: float = 15.0) -> dict[str, Scrape]:
    """Scrapes once both workers' pools are full again and nothing runs anywhere."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = scrape_all(cluster)
        if (pools_full(s["prefill"], P) and pools_full(s["decode"], D)
                and s["router"].value(f"{R}_running_requests") == 0) \
                or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def run_requests(cluster):
    async def scenario():
        outs = await asyncio.gather(*[generate(cluster.router_address, request_to_pb(
            token_ids=p, params=PARAMS, request_id=f"metrics-{i}"), timeout_s=120)
            for i, p in enumerate(PROMPTS)])
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await generate(cluster.router_address, request_to_pb(token_ids=[1, 10 ** 6],
                                                                 params=PARAMS))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return outs

    return asyncio.run(scenario())


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def test_every_endpoint_moves_by_what_was_served(cluster):
    before = idle_scrapes(cluster)
    outs = run_requests(cluster)
    after = idle_scrapes(cluster)
    n, new = len(PROMPTS), PARAMS.max_new_tokens
    prompt_tokens = sum(map(len, PROMPTS))
    assert all(o.finish_reason == "length" and len(o.token_ids) == new for o in outs)
    gaps = sum(len(o.inter_token_latencies_s) for o in outs)
    assert gaps == n * (new - 1)

    r0, r1 = before["router"], after["router"]
    assert delta(r0, r1, f"{R}_requests_total", finish_reason="length", status="OK") == n
    assert delta(r0, r1, f"{R}_requests_total", finish_reason="none",
                 status="INVALID_ARGUMENT") == 1
    assert delta(r0, r1, f"{R}_requests_total") == n + 1
    assert delta(r0, r1, f"{R}_time_to_first_token_seconds_count") == n
    assert delta(r0, r1, f"{R}_e2e_request_latency_seconds_count") == n
    assert delta(r0, r1, f"{R}_inter_token_latency_seconds_count") == gaps
    assert delta(r0, r1, f"{R}_prompt_tokens_total") == prompt_tokens
    assert delta(r0, r1, f"{R}_generation_tokens_total") == n * new
    assert r1.value(f"{R}_waiting_requests") == 0
    # the HTTP API's /metrics serves the same registry
    assert after["router_http"].value(f"{R}_requests_total") == r1.value(f"{R}_requests_total")

    p0, p1 = before["prefill"], after["prefill"]
    assert delta(p0, p1, f"{P}_requests_total", status="OK") == n
    assert delta(p0, p1, f"{P}_prompts_total") == n
    assert delta(p0, p1, f"{P}_prompt_tokens_total") == prompt_tokens
    for histogram in ("queue_time_seconds", "prefill_time_seconds", "handoff_time_seconds",
                      "handoff_bytes"):
        assert delta(p0, p1, f"{P}_{histogram}_count") == n, histogram
    assert delta(p0, p1, f"{P}_handoffs_total", result="sent") == n
    sent_bytes = delta(p0, p1, f"{P}_handoff_bytes_sum")
    assert sent_bytes > 0  # the byte stream: each prompt's KV and state went over gRPC

    d0, d1 = before["decode"], after["decode"]
    assert delta(d0, d1, f"{D}_requests_total", finish_reason="length") == n
    assert delta(d0, d1, f"{D}_admitted_requests_total") == n
    assert delta(d0, d1, f"{D}_spec_requests_total", speculative="yes") == n
    assert delta(d0, d1, f"{D}_spec_requests_total", speculative="no") == 0
    assert delta(d0, d1, f"{D}_generated_tokens_total") == n * new
    assert delta(d0, d1, f"{D}_handoffs_total", status="OK") == n
    assert delta(d0, d1, f"{D}_handoff_time_seconds_count") == n
    # what landed in the pools: the payload, without the messages' framing
    assert 0 < delta(d0, d1, f"{D}_handoff_bytes_sum") < sent_bytes
    # every token after the first came from a DFLASH step; each step's accept length reached
    # the client, and the decode worker counted the same steps
    steps = [a for o in outs for a in o.accept_lengths]
    assert steps and delta(d0, d1, f"{D}_spec_steps_total") == len(steps)
    assert delta(d0, d1, f"{D}_spec_accept_length_count") == len(steps)
    assert delta(d0, d1, f"{D}_spec_accept_length_sum") == sum(steps)
    assert delta(d0, d1, f"{D}_spec_draft_tokens_total") == len(steps) * 3
    assert delta(d0, d1, f"{D}_spec_accepted_tokens_total") == sum(steps) - len(steps)
    # each request's DFLASH step is in one engine step, which may carry several requests
    assert delta(d0, d1, f"{D}_step_requests_sum") == len(steps)
    assert 0 < delta(d0, d1, f"{D}_step_requests_count") <= len(steps)
    # each of those steps was timed, and took some time
    assert delta(d0, d1, f"{D}_step_time_seconds_count") == delta(
        d0, d1, f"{D}_step_requests_count")
    assert delta(d0, d1, f"{D}_step_time_seconds_sum") > 0

    for s, prefix in ((p1, P), (d1, D)):
        assert pools_full(s, prefix) and s.value(f"{prefix}_waiting_requests") == 0
        assert s.types[f"{prefix}_kv_pages_free"] == "gauge"

    # GetLoad reports the same totals the scrape shows
    token = cluster.internal_token
    prefill_load = asyncio.run(worker_load(worker(cluster, "prefill").address, "prefill", token))
    assert prefill_load.counters["prefilled"] == p1.value(f"{P}_prompts_total")
    assert prefill_load.counters["handoff_bytes"] == p1.value(f"{P}_handoff_bytes_sum")
    decode_load = asyncio.run(worker_load(worker(cluster, "decode").address, "decode", token))
    assert decode_load.counters["admitted"] == d1.value(f"{D}_admitted_requests_total")
    assert decode_load.counters["spec_steps"] == d1.value(f"{D}_spec_steps_total")


def test_json_log_lines_carry_one_request_id_through_all_three_services(cluster):
    run_requests(cluster)
    time.sleep(0.5)  # the last lines through the pipes
    rid = "metrics-2"
    for proc in (cluster.router, worker(cluster, "prefill"), worker(cluster, "decode")):
        lines = [line for line in proc.stderr_tail(200).splitlines() if rid in line]
        records = [json.loads(line) for line in lines]  # each one JSON object
        mine = [r for r in records if r.get("request_id") == rid]
        assert mine, f"{proc.name} logged nothing for {rid}:\n{proc.stderr_tail(20)}"
        assert all({"time", "level", "logger", "message"} <= set(r) for r in mine)
    # the workers know the request by its handoff id too; the id ties their lines together
    prefill = [json.loads(line) for line in worker(cluster, "prefill").stderr_tail(200)
               .splitlines() if rid in line]
    assert any(r["message"].startswith("handoff ") for r in prefill)


def test_up_gives_every_process_a_metrics_port_and_its_log_format():
    from router.cli import build_parser, cluster_config_from_args

    config = cluster_config_from_args(build_parser().parse_args(["up", "--log-format", "json"]))
    assert config.metrics and config.log_format == "json"


def test_a_restarted_worker_serves_its_metrics_on_the_port_it_had(cluster):
    index = next(i for i, w in enumerate(cluster.workers) if w.kind == "decode")
    old = cluster.workers[index]
    old.popen.kill()
    old.popen.wait()
    new = cluster.respawn(index)
    deadline = time.monotonic() + 60
    while not new.ready():
        assert new.alive() and time.monotonic() < deadline, new.stderr_tail()
        time.sleep(0.05)
    assert new.metrics_address == old.metrics_address
    s = scrape_url(new.metrics_url)
    assert s.value(f"{D}_admitted_requests_total") == 0  # a new process, counting afresh
    assert pools_full(s, D)
