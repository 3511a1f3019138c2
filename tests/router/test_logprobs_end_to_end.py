"""Log-probabilities through a real cluster (router, prefill and decode processes, the built-in
model and its DFLASH draft): the first token's are computed on prefill and cross in the
handoff's trailer, the rest on decode, with and without DFLASH, and each equals log_softmax of
the model's own logits at that position. On both APIs (the HTTP one through the official
``openai`` client)."""

from __future__ import annotations

import asyncio

import pytest

from common.chat_template import load_chat_template
from common.model.load import load_model
from common.sampling import SamplingParams
from common.tokenizer import ByteTokenizer
from router.cluster import Cluster, ClusterConfig
from router.remote import generate, request_to_pb
from tests.common.engine.test_engine_logprobs import raw_logprobs

# chunks of 5 prompt tokens on prefill, pages of 4: the first token follows a chunked prompt
WORKER_ARGS = ("--page-size", "4", "--num-pages", "512", "--num-slots", "16",
               "--max-prefill-tokens", "5", "--draft", "tiny")
PROMPTS = [[5, 17, 200], [(i * 37 + 11) % 256 for i in range(14)]]
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(model="tiny", worker_args=WORKER_ARGS, router_http_port=0,
                           router_args=("--poll-interval", "0.1"), start_timeout_s=120)
    with Cluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def run_grpc(cluster, prompt, params):
    return asyncio.run(generate(cluster.router_address, request_to_pb(
        token_ids=prompt, params=params), timeout_s=120))


def check(model, prompt, out, num_top, atol=1e-4):
    """Every token's log-probabilities against log_softmax of the model's logits: the chosen
    token's, and the alternatives' (each its own value, together the top values, most likely
    first; tokens whose values lie within ``atol`` may come in either order)."""
    reference = raw_logprobs(model, list(prompt), out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == reference.shape[0]
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(lp.logprob - reference[j, token].item()) <= atol, j
        values = [v for _, v in lp.top]
        assert len(lp.top) == num_top and values == sorted(values, reverse=True), j
        assert all(abs(reference[j, t].item() - v) <= atol for t, v in lp.top), j
        want = reference[j].topk(num_top).values.tolist()
        assert max(abs(v - w) for v, w in zip(values, want)) <= atol, j


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_greedy_logprobs_across_the_split(cluster, model, speculative):
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=3,
                            speculative=speculative)
    for prompt in PROMPTS:
        out = run_grpc(cluster, prompt, params)
        assert len(out.token_ids) == 12
        check(model, prompt, out, 3)
        if speculative:  # every token after the first came from a DFLASH step
            assert sum(out.accept_lengths) >= 11


def test_sampled_and_first_token_only_requests(cluster, model):
    sampled = SamplingParams(temperature=1.3, top_p=0.9, seed=7, max_new_tokens=8,
                             ignore_eos=True, logprobs=2, speculative=False)
    out = run_grpc(cluster, PROMPTS[1], sampled)
    check(model, PROMPTS[1], out, 2)  # the raw distribution, whatever the temperature
    # one token: the request ends on prefill, its log-probabilities come from there
    first = run_grpc(cluster, PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=1,
                                                         logprobs=5))
    assert first.finish_reason == "length"
    check(model, PROMPTS[0], first, 5)


def test_a_request_without_logprobs_then_one_with_them(cluster, model):
    """The decode worker serves a request that asks for none, then, in the same slots and
    batches, ones that do: each gets exactly what it asked for."""
    plain = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    asking = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=1)
    before = run_grpc(cluster, PROMPTS[1], plain)
    assert before.logprobs == []
    after = run_grpc(cluster, PROMPTS[1], asking)
    assert after.token_ids == before.token_ids
    check(model, PROMPTS[1], after, 1)

    async def together():
        return await asyncio.gather(*[generate(cluster.router_address, request_to_pb(
            token_ids=PROMPTS[i % 2], params=plain if i % 2 else asking), timeout_s=120)
            for i in range(4)])
    for i, out in enumerate(asyncio.run(together())):
        if i % 2:
            assert out.logprobs == []
        else:
            check(model, PROMPTS[0], out, 1)


def test_openai_client_reads_the_grpc_logprobs(cluster):
    import openai  # here, not at the top: the GPU case of this file needs no HTTP client

    grpc_out = run_grpc(cluster, PROMPTS[1], SamplingParams(
        temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=2))
    def text_of(token_id):
        return ByteTokenizer().decode([token_id], skip_special_tokens=False)

    text = [text_of(t) for t in grpc_out.token_ids]
    want = [lp.logprob for lp in grpc_out.logprobs]
    # the k most likely and the chosen token, by their text (byte tokens that are not whole
    # characters all read U+FFFD, so their entries merge, as with any OpenAI server)
    want_top = [{text_of(i): v for i, v in lp.top} for lp in grpc_out.logprobs]
    for t, lp, top in zip(text, grpc_out.logprobs, want_top):
        top.setdefault(t, lp.logprob)
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        args = dict(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                    logprobs=2, extra_body={"ignore_eos": True})
        unary = client.completions.create(**args).choices[0].logprobs
        # float32 values, carried exactly by protobuf and by JSON alike
        assert unary.tokens == text and unary.token_logprobs == want
        assert unary.top_logprobs == want_top
        streamed = [lp for c in client.completions.create(**args, stream=True)
                    if c.choices and c.choices[0].logprobs
                    for lp in c.choices[0].logprobs.token_logprobs]
        assert streamed == unary.token_logprobs

        prompt_ids = ByteTokenizer().encode(load_chat_template("tiny").render(MESSAGES),
                                            add_special_tokens=False)
        chat_grpc = run_grpc(cluster, prompt_ids, SamplingParams(
            temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=2))
        chat = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                    logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        content = client.chat.completions.create(**chat).choices[0].logprobs.content
        assert [c.logprob for c in content] == [lp.logprob for lp in chat_grpc.logprobs]
        assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == \
            [[(text_of(i), v) for i, v in lp.top] for lp in chat_grpc.logprobs]
        streamed = [c.model_dump() for chunk in client.chat.completions.create(**chat,
                                                                                 stream=True)
                    for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
        assert streamed == [c.model_dump() for c in content]


@pytest.mark.gpu
def test_on_a_gpu_with_graphs_and_overlap():
    """On a GPU the decode worker replays CUDA graphs and overlaps steps: a request without
    log-probabilities, then ones with them, alone and in one batch with it."""
    from common.model.kernels import select_kernels

    # the reference on the same GPU with the same kernels (its prefill ones, for one forward)
    model = load_model("tiny", device="cuda", kernels=select_kernels("gpu"))
    args = ("--device", "cuda", "--num-pages", "512", "--num-slots", "16")
    plain = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    asking = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True, logprobs=4)

    async def scenario(address):
        first = await generate(address, request_to_pb(token_ids=PROMPTS[1], params=plain))
        alone = await generate(address, request_to_pb(token_ids=PROMPTS[1], params=asking))
        mixed = await asyncio.gather(*[generate(address, request_to_pb(
            token_ids=PROMPTS[i % 2], params=asking if i % 2 else plain)) for i in range(6)])
        return first, alone, mixed

    for extra in ((), ("--draft", "tiny")):
        with Cluster(ClusterConfig(model="tiny", worker_args=args + extra,
                                   start_timeout_s=300)) as c:
            first, alone, mixed = asyncio.run(scenario(c.router_address))
        assert first.logprobs == [] and alone.token_ids == first.token_ids
        # decode and prefill kernels round differently: a bound well under the gaps between
        # positions' distributions
        check(model, PROMPTS[1], alone, 4, atol=5e-3)
        for i, out in enumerate(mixed):
            if i % 2:
                check(model, PROMPTS[1], out, 4, atol=5e-3)
            else:
                assert out.logprobs == []
