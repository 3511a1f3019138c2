"""The engine factory on the CPU: what it builds from settings, against engines built by hand
from the model, draft and config, and the workers', ``flashsplit generate``'s and the demo's
paths through it."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from common.engine.factory import EngineSettings, build_engine, choose_kernel_set, select_kernel_set
from common.engine.llm_engine import EngineConfig, LLMEngine
from common.handoff.layout import LayoutDescriptor, model_fingerprint
from common.model.dflash import load_draft
from common.model.load import eos_token_ids_for, load_model, weights_identity
from common.sampling import SamplingParams
from common.worker_args import engine_config_from_args, engine_settings_from_args
from common.worker_flags import add_worker_args

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def by_hand(config: EngineConfig = EngineConfig(), draft: str | None = None) -> LLMEngine:
    model = load_model("tiny", device=config.device)
    return LLMEngine(model, config, eos_token_ids_for("tiny", model.config),
                     draft=load_draft(draft, model) if draft else None)


def outputs(engine: LLMEngine, speculative: bool | None = None) -> list[list[int]]:
    params = dataclasses.replace(GREEDY, speculative=speculative)
    return [r.output_ids for r in engine.generate(PROMPTS, params)]


def worker_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_worker_args(p)
    return p.parse_args(["--model", "tiny", "--no-progress", *argv])


def test_the_tiny_model_builds_with_its_layout_fingerprint_and_eos():
    built = build_engine(EngineSettings(model="tiny"))
    model = load_model("tiny")
    assert built.engine.speculator is None and built.sizing is None
    assert built.layout == LayoutDescriptor.from_model(model.config, 16, model.dtype)
    assert built.fingerprint == model_fingerprint(model.config, weights_identity("tiny"))
    assert built.eos_token_ids == eos_token_ids_for("tiny", model.config)
    assert outputs(built.engine) == outputs(by_hand())


def test_the_tiny_draft_speculates_the_same_tokens_as_a_hand_built_engine():
    built = build_engine(EngineSettings(model="tiny", draft="tiny"))
    assert built.engine.speculator is not None
    reference = by_hand(draft="tiny")
    got = outputs(built.engine, speculative=True)
    assert got == outputs(reference, speculative=True)
    assert got == outputs(by_hand())  # greedy DFLASH commits what plain decoding would
    assert built.layout.page_size == reference.config.cache.page_size


def test_tensor_parallel_graphs_are_asked_for_by_a_flag():
    assert not engine_config_from_args(worker_args(), prefill=False).cuda_graph.tensor_parallel
    config = engine_config_from_args(worker_args("--tp", "2", "--tp-cuda-graphs"), prefill=False)
    assert config.cuda_graph.tensor_parallel


def test_the_speculation_batch_limit_is_a_worker_flag():
    assert engine_config_from_args(worker_args(), prefill=False) \
        .speculative_disable_by_batch_size is None
    args = worker_args("--speculative-disable-by-batch-size", "8")
    assert engine_config_from_args(args, prefill=False).speculative_disable_by_batch_size == 8


@pytest.mark.parametrize("flag,draft,verify,if_planned", [
    (None, False, False, True), ("auto", False, False, True), ("off", False, False, False),
    ("draft", True, False, False), ("step", True, True, False)])
def test_what_a_dflash_step_launches_ahead_is_a_worker_flag(flag, draft, verify, if_planned):
    args = worker_args(*([] if flag is None else ["--speculative-ahead", flag]))
    graphs = engine_config_from_args(args, prefill=False).cuda_graph
    assert (graphs.draft_ahead, graphs.verify_ahead) == (draft, verify)
    assert graphs.step_ahead_if_planned == if_planned


def test_a_block_size_reaches_the_speculator():
    built = build_engine(EngineSettings(model="tiny", draft="tiny", block_size=2))
    assert built.engine.speculator.block_size == 2


@pytest.mark.parametrize("prefill", [False, True])
def test_a_worker_engine_is_the_one_its_flags_describe(prefill):
    args = worker_args("--page-size", "8", "--num-pages", "256", "--draft", "tiny")
    built = build_engine(engine_settings_from_args(args, prefill=prefill))
    config = engine_config_from_args(args, prefill=prefill)
    assert built.engine.config == config
    assert built.layout.page_size == 8 and built.sizing.num_pages == 256
    if not prefill:
        assert outputs(built.engine, speculative=True) == outputs(by_hand(config, "tiny"),
                                                                  speculative=True)


def test_workers_warm_up_always_and_one_shot_runs_only_for_graphs(monkeypatch):
    calls = []
    monkeypatch.setattr(LLMEngine, "warmup", lambda self, progress=True: calls.append(progress))
    build_engine(EngineSettings(model="tiny"))
    assert calls == []  # no graphs on the CPU: nothing to capture
    build_engine(engine_settings_from_args(worker_args(), prefill=False))
    assert calls == [False]  # --no-progress


def test_settings_refuse_an_unknown_warmup_policy():
    with pytest.raises(ValueError, match="warmup must be one of"):
        EngineSettings(model="tiny", warmup="sometimes")


def test_auto_kernels_are_the_cpu_set_on_the_cpu():
    from common.ops.gpu_backends import chosen_backends
    from common.model.kernels import MODEL_OPS

    assert select_kernel_set(None, "cpu") is None
    kernels = select_kernel_set("auto", "cpu")
    cpu_set = chosen_backends("cpu", list(MODEL_OPS))
    assert dict(kernels.backends) == cpu_set
    assert set(cpu_set.values()) != {"reference"}
    reference = select_kernel_set("reference", "cpu")
    assert set(dict(reference.backends).values()) == {"reference"}


def test_auto_kernels_on_cuda_pass_over_a_set_whose_libraries_do_not_load(monkeypatch, caplog):
    """``auto`` on a CUDA device without FlashInfer takes the Triton attention set, and says
    so; a set named on the command line is never swapped for another."""
    from common.model import kernels as model_kernels

    def select(name):
        if name == "gpu":
            raise ValueError("kernel set 'gpu' needs its GPU libraries (No module named 'flashinfer')")
        return f"kernels of {name}"

    monkeypatch.setattr(model_kernels, "select_kernels", select)
    with caplog.at_level("WARNING"):
        assert select_kernel_set("auto", "cuda:0") == "kernels of gpu-triton-attention"
    assert "gpu unavailable, taking gpu-triton-attention" in caplog.text
    assert "flashinfer" in caplog.text
    with pytest.raises(ValueError, match="flashinfer"):
        select_kernel_set("gpu", "cuda:0")
    assert select_kernel_set("gpu-fla", "cuda:0") == "kernels of gpu-fla"
    assert choose_kernel_set("auto", "cuda:0") == (
        "gpu-triton-attention", "kernels of gpu-triton-attention")


def test_auto_kernels_of_a_speculating_decode_engine_plan_attention_on_the_device(monkeypatch):
    """A decode engine with a draft on one GPU takes the Triton attention for ``auto`` (its
    plans let the next step go ahead); the prefill side and draft-less engines keep the plain
    choice, and a named set stays what it is."""
    import common.engine.factory as factory
    from common.model import kernels as model_kernels

    with monkeypatch.context() as patched:
        patched.setattr(model_kernels, "select_kernels", lambda name: f"kernels of {name}")
        assert select_kernel_set("auto", "cuda:0", speculative_decode=True) \
            == "kernels of gpu-triton-attention"
        assert select_kernel_set("auto", "cuda:0") == "kernels of gpu"
        assert select_kernel_set("gpu", "cuda:0", speculative_decode=True) == "kernels of gpu"

    asked = []
    select = factory.select_kernel_set
    monkeypatch.setattr(factory, "select_kernel_set", lambda name, device, **kw: (
        asked.append(kw.get("speculative_decode")), select(name, "cpu"))[1])
    build_engine(EngineSettings(model="tiny", draft="tiny", kernels="auto"))
    build_engine(EngineSettings(model="tiny", kernels="auto"))
    build_engine(EngineSettings(model="tiny", draft="tiny", kernels="auto",
                                engine=EngineConfig(hold_after_prefill=True)))
    assert asked == [True, False, False]


def test_generate_in_process_speculates_through_the_factory(capsys):
    from router.cli import main

    assert main(["generate", "--model", "tiny", "--json", "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "8",
                 "--temperature", "0", "--ignore-eos", "--draft", "tiny",
                 "--speculative", "on"]) == 0
    out = json.loads(capsys.readouterr().out)
    (req,) = by_hand(draft="tiny").generate([PROMPTS[0]],
                                            dataclasses.replace(GREEDY, speculative=True))
    assert out["token_ids"] == req.output_ids and out["accept_lengths"] == req.accept_lengths


def test_the_demo_reference_is_a_hand_built_engine():
    from common.tokenizer import load_tokenizer
    from router.demo import DEMO_PROMPTS, local_reference

    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    tokenizer = load_tokenizer("tiny")
    expected = [r.output_ids for r in
                by_hand().generate([tokenizer.encode(p) for p in DEMO_PROMPTS], params)]
    assert local_reference("tiny", DEMO_PROMPTS, params) == expected


def test_the_prefill_chunk_is_larger_on_a_gpu_unless_given():
    assert engine_config_from_args(worker_args(), prefill=True).scheduler.max_prefill_tokens \
        == 2048
    gpu = worker_args("--device", "cuda")
    assert engine_config_from_args(gpu, prefill=True).scheduler.max_prefill_tokens == 8192
    given = worker_args("--device", "cuda", "--max-prefill-tokens", "1024")
    assert engine_config_from_args(given, prefill=False).scheduler.max_prefill_tokens == 1024


def test_a_cpu_worker_gives_its_torch_threads_to_the_engine_thread():
    import torch

    from common.worker_args import worker_engine

    before = torch.get_num_threads()
    try:
        with worker_engine(worker_args(), prefill=False) as (_, built):
            assert built.engine.config.cpu_threads == before
            assert torch.get_num_threads() == 1  # the main thread keeps one
    finally:
        torch.set_num_threads(before)


def test_a_device_per_rank_takes_the_gpu_chunk():
    ranks = worker_args("--device", "cuda:0,cuda:1", "--tp", "2")
    assert engine_config_from_args(ranks, prefill=True).scheduler.max_prefill_tokens == 8192


def test_a_cpu_worker_engine_computes_with_its_cpu_threads():
    import torch

    from common.cpu_threads import available_cpus
    from common.worker_args import engine_cpu_threads

    main_threads = torch.get_num_threads()
    try:
        assert engine_cpu_threads(worker_args("--cpu-threads", "3"), 1) == 3
        assert torch.get_num_threads() == 1  # the main thread keeps one
        assert engine_cpu_threads(worker_args(), 1) == available_cpus()
        torch.set_num_threads(2)  # as a group of two sets rank 0's share
        assert engine_cpu_threads(worker_args("--tp", "2", "--cpu-threads", "4"), 2) == 2
    finally:
        torch.set_num_threads(main_threads)
