"""Kernel sets, and whole models on the GPU with the "gpu" set against the reference set.

- The built-in tiny model (fp32, head dims 32: GDN runs on fla, attention falls back to the
  reference) generates the same greedy tokens with both sets. A different token is accepted only
  at a near-tie: where the reference's margin between the two tokens is within twice the largest
  logit difference the two sets showed at that step (an argmax flip that numerics alone explain).
- A Qwen3.5-4B-shaped bf16 model cut to 2 layers (one GDN, one full attention; random weights)
  gives the same logits within bf16 tolerance (relative RMSE <= 2e-2, cosine >= 0.9998) through
  prefill, a chunked-prefill continuation and decode steps, and leaves the same GDN states.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.model.kernels import select_kernels
from common.ops import gpu_backends
from common.ops.registry import CPU_BACKEND, CPU_OPS, GPU_OPS, default_registry
from tests.common.compare import cosine, rel_rmse

PAGE = 16


def test_backend_sets_name_registered_backends():
    assert gpu_backends.backends_for("reference") == {}
    for name in gpu_backends.BACKEND_SETS:
        for op, backend in gpu_backends.backends_for(name).items():
            assert backend in GPU_OPS.get(op, {}) or (backend == CPU_BACKEND and op in CPU_OPS)
            assert backend in default_registry().backends(op)
    chosen = gpu_backends.chosen_backends("gpu")
    assert chosen["paged_attention"] == "flashinfer" and chosen["l2norm"] == "reference"
    for op in ("gdn_gating", "apply_rope"):
        assert chosen[op] == "triton" and gpu_backends.chosen_backends("gpu-fla")[op] == "triton"
    for op in ("rms_norm", "gated_rms_norm"):
        assert chosen[op] == "triton-pdl" == gpu_backends.chosen_backends("gpu-fla")[op]
    assert gpu_backends.describe("gpu").startswith("gpu: ")
    assert chosen["linear"] == "triton-pdl" and chosen["sparse_moe"] == "triton"
    plain = gpu_backends.chosen_backends("gpu-no-pdl")
    assert plain["linear"] == "triton" and plain["paged_attention"] == "flashinfer"
    with pytest.raises(ValueError, match="known: cpu, gpu, gpu-fla, gpu-no-pdl, gpu-triton-attention, reference"):
        gpu_backends.backends_for("fast")
    assert gpu_backends.sets_for_device("auto", "cuda:1")[0] == "gpu"
    assert gpu_backends.sets_for_device("auto", "cpu")[0] == "cpu"
    assert gpu_backends.sets_for_device("gpu-fla", "cpu")[0] == "gpu-fla"


def test_reference_set_selects_reference_kernels():
    kernels = select_kernels("reference")
    assert all(b == "reference" for _, b in kernels.backends)


class Runner:
    """Drives a model through explicit forwards over its own pools (no scheduler)."""

    def __init__(self, model, prompts_total, page=PAGE):
        from common.engine.llm_engine import CacheConfig, make_pools

        pages_needed = sum(-(-t // page) for t in prompts_total) + 2
        self.model, self.page = model, page
        self.kv_pool, self.state_pool = make_pools(
            model, CacheConfig(page_size=page, num_pages=pages_needed, num_slots=len(prompts_total) + 1),
            "cuda")
        self.pages = [self.kv_pool.allocator.allocate(-(-t // page)) for t in prompts_total]
        self.slots = [self.state_pool.allocate() for _ in prompts_total]

    def forward(self, mode, tokens, prefix, all_logits=False):
        from common.model.forward_batch import ForwardBatch

        batch = ForwardBatch.build(mode=mode, token_ids=tokens, prefix_lens=prefix, page_ids=self.pages,
                                   page_size=self.page, state_slots=self.slots,
                                   return_all_logits=all_logits, device="cuda")
        return self.model(batch, kv_pool=self.kv_pool, state_pool=self.state_pool).logits


def greedy(model, prompts, steps):
    """Chunked prefill (two halves), then ``steps`` decode steps; tokens [N, steps], logits [N, steps, V]."""
    from common.model.forward_batch import ForwardMode

    run = Runner(model, [len(p) + steps for p in prompts], page=4)
    half = [len(p) // 2 for p in prompts]
    run.forward(ForwardMode.EXTEND, [p[:h] for p, h in zip(prompts, half)], [0] * len(prompts))
    logits = run.forward(ForwardMode.EXTEND, [p[h:] for p, h in zip(prompts, half)], half)
    prefix = [len(p) for p in prompts]
    toks, all_logits = [], []
    for _ in range(steps):
        all_logits.append(logits)
        tok = logits.argmax(-1)
        toks.append(tok)
        logits = run.forward(ForwardMode.DECODE, [[t] for t in tok.tolist()], prefix)
        prefix = [x + 1 for x in prefix]
    return torch.stack(toks, 1).tolist(), torch.stack(all_logits, 1)


@pytest.mark.gpu
def test_tiny_model_greedy_tokens_match(record_metric):
    pytest.importorskip("fla", reason="fla-core is not installed")
    from common.model.load import load_model

    model = load_model("tiny", device="cuda")
    prompts = [[int(x) for x in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (2, 23, 61, 130)]
    steps = 32
    model.kernels = select_kernels("reference")
    ref_toks, ref_logits = greedy(model, prompts, steps)
    model.kernels = select_kernels("gpu")
    got_toks, got_logits = greedy(model, prompts, steps)
    record_metric("first_step_logits.rel_rmse", rel_rmse(got_logits[:, 0], ref_logits[:, 0]))
    assert rel_rmse(got_logits[:, 0], ref_logits[:, 0]) <= 1e-3
    matched = 0
    for r, (want, got) in enumerate(zip(ref_toks, got_toks)):
        for s, (a, b) in enumerate(zip(want, got)):
            if a == b:
                matched += 1
                continue
            # the histories are equal up to here, so the logits differ by kernel numerics only
            noise = (got_logits[r, s] - ref_logits[r, s]).abs().max().item()
            margin = (ref_logits[r, s, a] - ref_logits[r, s, b]).item()
            record_metric(f"request{r}.divergence_step", s)
            assert margin <= 2 * noise, (f"request {r} step {s}: token {b} instead of {a}, reference "
                                         f"margin {margin:.3e} > 2 x logit noise {noise:.3e}")
            break
    record_metric("tokens_matched", matched)
    record_metric("tokens_total", steps * len(prompts))


@pytest.fixture(scope="module")
def model_4b_2l():
    from benchmarks.shapes import shape_config
    from common.model.builtin import fill_deterministic
    from common.model.family_registry import model_class_for

    config = dataclasses.replace(shape_config("qwen3.5-4b"), num_hidden_layers=2,
                                 layer_types=("linear_attention", "full_attention"))
    with torch.device("cuda"):
        model = model_class_for(config)(config, dtype=torch.bfloat16)
    fill_deterministic(model.named_parameters(), seed=7)
    return model.eval()


@pytest.mark.gpu
def test_qwen35_4b_shaped_logits_match(record_metric, model_4b_2l):
    pytest.importorskip("fla", reason="fla-core is not installed")
    pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    from common.model.forward_batch import ForwardMode

    model = model_4b_2l
    gen = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    first = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (300, 77)]
    second = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (50, 13)]
    decode_steps = 3
    total = [a + b + decode_steps for a, b in zip((300, 77), (50, 13))]
    runs = {}
    for name in ("reference", "gpu"):
        model.kernels = select_kernels(name)
        run = Runner(model, total)
        logits = [run.forward(ForwardMode.EXTEND, first, [0, 0], all_logits=True)]
        logits.append(run.forward(ForwardMode.EXTEND, second, [300, 77], all_logits=True))
        prefix = [350, 90]
        gen_d = torch.Generator().manual_seed(12)
        for _ in range(decode_steps):
            toks = torch.randint(0, vocab, (2,), generator=gen_d).tolist()  # same tokens for both sets
            logits.append(run.forward(ForwardMode.DECODE, [[t] for t in toks], prefix))
            prefix = [x + 1 for x in prefix]
        runs[name] = (logits, run)
    for i, (want, got) in enumerate(zip(runs["reference"][0], runs["gpu"][0])):
        rm, cs = rel_rmse(got, want), cosine(got, want)
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        record_metric(f"forward{i}.logits.rel_rmse", rm)
        record_metric(f"forward{i}.logits.cosine", cs)
        record_metric(f"forward{i}.argmax_agreement", agree)
        assert rm <= 2e-2 and cs >= 0.9998, f"forward {i}: rel RMSE {rm:.3e}, cosine {cs:.6f}"
    ref_run, gpu_run = runs["reference"][1], runs["gpu"][1]
    slots = ref_run.slots
    ssm_rm = rel_rmse(gpu_run.state_pool.ssm[:, slots], ref_run.state_pool.ssm[:, slots])
    conv_rm = rel_rmse(gpu_run.state_pool.conv[:, slots], ref_run.state_pool.conv[:, slots])
    record_metric("ssm_state.rel_rmse", ssm_rm)
    record_metric("conv_state.rel_rmse", conv_rm)
    assert ssm_rm <= 2e-2 and conv_rm <= 2e-2
