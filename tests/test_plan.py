"""`shardformer plan` gives exactly the parameter shapes a real tensor-parallel shard has."""

import torch
import torch.distributed as dist

from shardformer import ShardConfig, shard_model
from shardformer.cli.main import main
from shardformer.plan import build_meta_model, plan_model
from shardformer.testing import run_on_ranks
from tests.policies import zoo

NAMES = ["GPT2LMHeadModel", "BertForMaskedLM", "ViTForImageClassification"]


def _real_shapes():
    out = {}
    for name in NAMES:
        _, model = zoo.load_twice(name)
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
        out[name] = {n: (tuple(p.shape), p.numel() * p.element_size()) for n, p in model.named_parameters()}
    return out


def _saved(name, folder):
    import transformers as tf

    torch.manual_seed(0)
    getattr(tf, name)(zoo.config_for(name)).save_pretrained(folder)
    return str(folder)


def test_plan_matches_a_real_tp2_shard_byte_for_byte(tmp_path):
    real = run_on_ranks(_real_shapes, 2)
    for name in NAMES:
        folder = _saved(name, tmp_path / name)
        plan = plan_model(build_meta_model(folder), tp=2)
        planned = {n: (local, int(torch.Size(local).numel()) * 4) for n, _, local in plan.params}
        for rank_shapes in real:
            assert planned == rank_shapes[name], name
        assert plan.rank_numel * 4 == sum(b for _, b in real[0][name].values())
        # the stage split covers every layer once and every parameter at least once
        stages = plan_model(build_meta_model(folder), tp=2, pp=2).stages
        assert [list(layers) for layers, _ in stages] == [[0], [1]]
        assert sum(n for _, n in stages) >= plan.rank_numel


def test_cli_prints_the_plan_and_refuses_sizes_that_do_not_fit(tmp_path, capsys):
    folder = _saved("GPT2LMHeadModel", tmp_path / "gpt2")
    assert main(["plan", folder, "--tp", "2", "--dp", "2", "--zero", "1"]) == 0
    out = capsys.readouterr().out
    assert "Conv1D -> Linear1D_Col" in out and "transformer.wte.weight: [99, 32] -> [50, 32]  [split]" in out
    assert "optimizer (Adam + master)" in out
    assert main(["plan", folder, "--tp", "2", "--pp", "2", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: layers 0..0" in out and "stage 1: layers 1..1" in out
    assert main(["plan", folder, "--tp", "3"]) == 2
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in capsys.readouterr().err
    assert main(["plan", "no-such-model"]) == 2
    assert "built-in name" in capsys.readouterr().err
