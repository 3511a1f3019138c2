"""Loading one rank's shard (common/model/loader.py with a ShardPlan): each rank's parameters are
its part of the full model's, and it reads only that part of the checkpoint. No processes: the
loader needs the plan, not the group."""

from __future__ import annotations

import pytest
import torch

import common.model.loader as loader
from common.model.family_registry import model_class_for, read_model_config
from common.model.load import load_model
from common.parallel.group import TensorParallelGroup
from tests.common.model.checkpoints import make_checkpoint

KINDS = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "qwen3_5")


def rank_of(rank: int, world_size: int) -> TensorParallelGroup:
    """A group that only says which rank this is: loading runs no collective."""
    stand_in = object()
    return TensorParallelGroup(rank, world_size, stand_in, stand_in)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    return {kind: make_checkpoint(kind, root / kind, tie=kind == "qwen3_5") for kind in KINDS}


class CountingSlice:
    """A safetensors slice that counts the elements read through it."""

    def __init__(self, inner, counter: list[int]) -> None:
        self.inner, self.counter = inner, counter

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        out = self.inner[index]
        self.counter[0] += out.numel()
        return out


@pytest.mark.parametrize("kind, expert_parallel", [
    *((kind, False) for kind in KINDS), ("qwen3_next", True), ("qwen3_5_moe_text", True)])
def test_each_rank_holds_its_part_of_the_full_model(checkpoints, kind, expert_parallel):
    path = checkpoints[kind]
    config = read_model_config(path)
    full = dict(load_model(str(path)).named_parameters())
    for world in (2, 4):
        for rank in range(world):
            model = model_class_for(config)(config, tp=rank_of(rank, world),
                                            expert_parallel=expert_parallel)
            params = dict(model.named_parameters())
            loader.load_weights(params, path, config, plan=model.shard_plan)
            for name, p in params.items():
                assert torch.equal(p, model.shard_plan.take(name, full[name])), (world, rank, name)


def test_a_rank_reads_only_its_part(checkpoints, monkeypatch):
    path = checkpoints["qwen3_next"]
    config = read_model_config(path)
    real_open = loader.safe_open

    def reads(tp):
        counter = [0]

        class CountingFile:
            def __init__(self, *args, **kwargs):
                self.inner = real_open(*args, **kwargs)

            def __enter__(self):
                self.f = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                return CountingSlice(self.f.get_slice(name), counter)

        monkeypatch.setattr(loader, "safe_open", CountingFile)
        model = model_class_for(config)(config, tp=tp)
        loader.load_weights(dict(model.named_parameters()), path, config, plan=model.shard_plan)
        return counter[0], sum(p.numel() for p in model.parameters())

    whole, whole_params = reads(None)
    assert whole == whole_params  # each tensor is read once, even one that fills two
    for world in (2, 4):
        for rank in range(world):
            read, held = reads(rank_of(rank, world))
            assert read < 1.5 * whole / world
            if world == 2:  # nothing replicated: each element read is one this rank holds
                assert read == held


def test_a_wrong_full_shape_is_refused_before_a_part_is_read(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = checkpoints["qwen3_5_text"]
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:4]])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, bad / "model.safetensors")
    config = read_model_config(bad)
    model = model_class_for(config)(config, tp=rank_of(0, 2))
    with pytest.raises(loader.WeightLoadError, match="of the full model"):
        loader.load_weights(dict(model.named_parameters()), bad, config, plan=model.shard_plan)


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5"])  # separate head, tied head
def test_the_full_vocabulary_for_a_draft_is_the_full_models(checkpoints, kind):
    from common.model.load import full_vocabulary

    path = checkpoints[kind]
    config = read_model_config(path)
    full = load_model(str(path))
    embed, head = full_vocabulary(str(path), config, dtype=torch.float32, device="cpu")
    assert torch.equal(embed, full.get_input_embeddings().weight)
    assert torch.equal(head, full.get_output_weight())
    assert (head is embed) == config.tie_word_embeddings
