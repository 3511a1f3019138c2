"""``flashsplit generate`` in process: the stable JSON interface."""

from __future__ import annotations

import json

import pytest

from common.engine.factory import select_kernel_set
from common.engine.llm_engine import EngineConfig, LLMEngine
from common.model.load import load_model
from common.sampling import SamplingParams
from common.tokenizer import ByteTokenizer
from router.cli import main


def run_json(capsys, *args) -> dict:
    assert main(["generate", "--model", "tiny", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def engine() -> LLMEngine:
    """The engine ``generate`` runs in process: the tiny model with the default kernel set
    (``auto``; logprobs are compared exactly, so the kernels must be the same)."""
    return LLMEngine(load_model("tiny", kernels=select_kernel_set("auto", "cpu")), EngineConfig())


def test_generate_json_matches_the_engine(capsys):
    out = run_json(capsys, "--prompt-ids", "1,2,3", "--max-new-tokens", "6",
                   "--temperature", "0")
    (req,) = engine().generate(
        [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=6))
    assert out["token_ids"] == req.output_ids
    assert out["text"] == ByteTokenizer().decode(req.output_ids)
    assert out["prompt_tokens"] == 3 and out["finish_reason"] in ("stop", "length")


def test_generate_json_reports_logprobs_when_asked(capsys):
    out = run_json(capsys, "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                   "--temperature", "0", "--ignore-eos", "--logprobs", "2")
    (req,) = engine().generate(
        [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True,
                                    logprobs=2))
    assert out["logprobs"] == [{"logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                               for lp in req.logprobs]
    assert len(out["logprobs"]) == 4 and all(len(lp["top"]) == 2 for lp in out["logprobs"])
    assert "logprobs" not in run_json(capsys, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1", "--logprobs", "21"]) == 2
    assert "logprobs" in capsys.readouterr().err


def test_generate_text_prompt_and_seeded_sampling_is_reproducible(capsys):
    args = ("--prompt", "héllo", "--max-new-tokens", "8", "--temperature", "0.8",
            "--top-k", "20", "--top-p", "0.9", "--seed", "7")
    first, second = run_json(capsys, *args), run_json(capsys, *args)
    assert first["token_ids"] == second["token_ids"]
    assert first["prompt_tokens"] == len("héllo".encode())


def test_generate_rejects_bad_input(capsys):
    with pytest.raises(SystemExit, match="comma-separated integers"):
        main(["generate", "--model", "tiny", "--prompt-ids", "1,x", "--max-new-tokens", "2"])
    assert main(["generate", "--model", "tiny", "--prompt-ids", "999", "--max-new-tokens", "2"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--draft", "tiny"], ["--block-size", "4"]])
def test_generate_through_a_router_refuses_draft_flags(capsys, flag):
    # refused before any call: nothing listens on this address
    assert main(["generate", "--router", "127.0.0.1:1", "--prompt", "Hi", *flag]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag[0]} is for in-process generation" in err
    assert "up --draft" in err


def test_speculative_on_without_a_draft_is_an_error_in_process(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "Hi", "--speculative", "on"]) == 2
    assert "--speculative on needs --draft" in capsys.readouterr().err


def test_generate_with_tensor_parallelism_gives_the_same_tokens(capsys):
    # seeded sampling: the tokens are drawn once, on rank 0, from the gathered logits
    args = ("--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "8", "--temperature", "0.8",
            "--seed", "3")
    single = run_json(capsys, *args)
    sharded = run_json(capsys, *args, "--tp", "2")
    assert sharded["token_ids"] == single["token_ids"]


def test_a_tensor_parallel_size_that_does_not_divide_is_an_error(capsys):
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1", "--tp", "3"]) == 2
    assert "cannot be split over 3 ranks" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1", "--tp", "2",
                 "--expert-parallel"]) == 2
    assert "expert parallelism needs routed experts" in capsys.readouterr().err
    assert main(["generate", "--router", "127.0.0.1:1", "--prompt", "Hi", "--tp", "2"]) == 2
    assert "--tp is for in-process generation" in capsys.readouterr().err
