"""`shardformer plan` gives exactly the parameter shapes a real tensor-parallel shard has, and an
activation estimate equal to the bytes a real forward keeps for the backward (tensor, sequence and
context parallelism)."""

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from shardformer import ShardConfig, shard_model
from shardformer.cli.main import main
from shardformer.core.tiny import tiny_config
from shardformer.tools.activation_estimate import estimate_activations
from shardformer.tools.plan import build_meta_model, plan_model
from shardformer.tools.testing import run_on_ranks
from tests.helpers import saved_for_backward
from tests.policies import zoo

NAMES = ["GPT2LMHeadModel", "BertForMaskedLM", "ViTForImageClassification"]


def _on_two_ranks():
    out = {}
    for name in NAMES:
        _, model = zoo.load_twice(name)
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
        out[name] = {n: (tuple(p.shape), p.numel() * p.element_size()) for n, p in model.named_parameters()}
    out["held vs estimate"] = _held_and_estimated(dist.get_world_size())
    out["cp: held vs estimate"] = _held_and_estimated_cp(dist.get_world_size())
    return out


@pytest.fixture(scope="module")
def two_ranks():
    """One spawn of 2 ranks: real tp=2 shards, and what tp=2 / cp=2 forwards keep for the backward."""
    return run_on_ranks(_on_two_ranks, 2)


# -- activation memory: the estimate against what a forward really keeps ------------------------

BATCH, SEQ = 2, 64


def _activation_models(attn_pdrop=0.1):
    gpt2 = tf.GPT2Config(
        vocab_size=99, n_embd=128, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.1, embd_pdrop=0.1,
        attn_pdrop=attn_pdrop, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    llama = tf.LlamaConfig(
        vocab_size=99, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    for cls, config, impl in ((tf.GPT2LMHeadModel, gpt2, "eager"), (tf.LlamaForCausalLM, llama, "sdpa")):
        torch.manual_seed(0)
        yield cls._from_config(config, attn_implementation=impl).train()


def _held_bytes(model, ids) -> int:
    """Bytes a training forward keeps for the backward (see tests.helpers.saved_for_backward)."""
    return saved_for_backward(model, lambda: model(input_ids=ids, labels=ids).loss)[1]


# tp > 1 also with sequence parallelism, re-gathering the column layers' inputs (the default) or keeping them
SEQUENCE_PARALLEL = {
    "": {},
    " + sequence parallel": {"sequence_parallel": True},
    " + sequence parallel (keep gathered)": {"sequence_parallel": True, "sequence_parallel_regather": False},
}


def _held_and_estimated(tp):
    ids = torch.randint(3, 99, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    out = {}
    for suffix, options in SEQUENCE_PARALLEL.items() if tp > 1 else [("", {})]:
        for model in _activation_models():
            if tp > 1:
                model = shard_model(model, ShardConfig(tensor_parallel_size=tp, **options))
            out[model.config.model_type + suffix] = (
                _held_bytes(model, ids),
                estimate_activations(model.config, BATCH, SEQ, tp, **options).total,
            )
    return out


def _held_and_estimated_cp(cp):
    """cp ranks split the sequence; each keeps its tokens' activations and the attention's own tensors
    (ring: q, k, v, its output, a log-sum-exp; all-to-all: the model's attention on cp-th of the heads
    over the whole sequence). GPT-2 keeps its residual and embedding dropout (seeded bool masks); the
    ring refuses attention dropout, so its GPT-2 has none, while the all-to-all's keeps eager
    attention probabilities with dropout."""
    ids = torch.randint(3, 99, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("ring", "all_to_all"):
        for model in _activation_models(attn_pdrop=0.0 if mode == "ring" else 0.1):
            options = {"context_parallel_size": cp, "context_parallel_mode": mode}
            estimate = estimate_activations(model.config, BATCH, SEQ, **options).total  # before: cp changes the config
            model = shard_model(model, ShardConfig(**options))
            out[f"{model.config.model_type} cp={cp} {mode}"] = (_held_bytes(model, ids), estimate)
    return out


def _assert_estimates(held_and_estimated, where):
    for kind, (held, estimate) in held_and_estimated.items():
        assert abs(estimate / held - 1) < 0.02, f"{kind} at {where}: estimated {estimate:,} bytes, held {held:,}"


def test_activation_estimate_equals_what_a_forward_keeps_unsharded():
    _assert_estimates(_held_and_estimated(1), "tp=1")


def test_activation_estimate_structure():
    config = next(_activation_models()).config
    est = lambda tp=2, seq=SEQ, **kw: estimate_activations(config, BATCH, seq, tp, sharded=True, **kw)  # noqa: E731
    one, two = est(tp=1), est()
    assert two.layer_split * 2 == one.layer_split and two.layer_whole == one.layer_whole  # tp splits the interior
    sp = est(sequence_parallel=True)  # the column layers' inputs re-gathered in backward: all of it split
    assert sp.layer_whole == two.layer_whole // 2 and sp.layer_split == two.layer_split
    keep = est(sequence_parallel=True, sequence_parallel_regather=False)
    entry_inputs = 2 * BATCH * SEQ * config.n_embd * 4  # the gathered norm outputs the column layers keep
    assert keep.layer_whole - entry_inputs == (two.layer_whole - entry_inputs) // 2
    outside = lambda e: e.parts["final norm + head input"]  # noqa: E731
    assert outside(sp) * 2 == outside(two)  # the final norm runs on the chunk, the head keeps the chunk
    head_input = BATCH * SEQ * config.n_embd * 4  # kept gathered by the head without re-gathering
    assert (outside(keep) - head_input) * 2 == outside(two) - head_input
    ckpt = est(checkpointing=True)
    assert ckpt.parts["layer inputs (checkpointed)"] == config.n_layer * BATCH * SEQ * config.n_embd * 4
    assert ckpt.recompute == two.layer_whole + two.layer_split and ckpt.total < two.total
    assert (
        est(checkpointing=True, sequence_parallel=True).parts["layer inputs (checkpointed)"] * 2
        == (ckpt.parts["layer inputs (checkpointed)"])
    )
    totals = [est(seq=s).total for s in (16, 32, 64, 128)]
    assert totals == sorted(totals) and len(set(totals)) == 4
    with pytest.raises(NotImplementedError, match="model_type='bert'"):
        estimate_activations(zoo.bert_config(), BATCH, SEQ)
    with pytest.raises(ValueError, match="seq=0 must be at least 1"):
        estimate_activations(config, BATCH, 0)


def _saved(name, folder):
    import transformers as tf

    torch.manual_seed(0)
    getattr(tf, name)(zoo.config_for(name)).save_pretrained(folder)
    return str(folder)


def test_activation_estimate_with_context_parallelism(two_ranks):
    """Within 2% of what each cp=2 rank keeps (ring and all-to-all), and about half of cp=1's."""
    for rank in two_ranks:
        _assert_estimates(rank["cp: held vs estimate"], "tp=1")
    config = next(_activation_models(attn_pdrop=0.0)).config
    one = estimate_activations(config, BATCH, SEQ, sharded=True).total
    for mode in ("ring", "all_to_all"):
        two = estimate_activations(config, BATCH, SEQ, context_parallel_size=2, context_parallel_mode=mode)
        assert 0.45 < two.total / one < 0.55, (mode, two.total, one)
        # a length 2 x cp does not divide is padded: the estimate counts the padded tokens
        padded = estimate_activations(config, BATCH, SEQ - 3, context_parallel_size=2, context_parallel_mode=mode)
        assert padded.total == two.total
    with pytest.raises(ValueError, match="context_parallel_mode='ring' refuses attention dropout"):
        estimate_activations(next(_activation_models()).config, BATCH, SEQ, context_parallel_size=2)


def test_plan_matches_a_real_tp2_shard_byte_for_byte(tmp_path, two_ranks):
    real = [{k: v for k, v in rank.items() if "held vs estimate" not in k} for rank in two_ranks]
    _assert_estimates(two_ranks[0]["held vs estimate"], "tp=2")
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
    assert main(["plan", folder, "--tp", "2", "--summary", "--batch", "2", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "activations per rank, batch 2 x seq 16" in out and "+ sequence parallel" in out
    assert main(["plan", folder, "--tp", "2", "--pp", "2", "--summary", "--batch", "2", "--seq", "16"]) == 0
    assert "of the whole model (all layers, not one of the 2 pipeline stages" in capsys.readouterr().out
    assert main(["plan", folder]) == 0  # tp=1: the layers become parallel forms, yet nothing is cut
    out = capsys.readouterr().out
    assert "nothing is cut at tp=1: every rank holds every layer whole" in out and "replaced modules" not in out
    assert main(["plan", folder, "--batch", "2"]) == 2
    assert "give both (--batch and --seq)" in capsys.readouterr().err
    assert main(["plan", "no-such-model"]) == 2
    assert "built-in name" in capsys.readouterr().err


def test_cli_plans_context_parallelism(tmp_path, capsys):
    folder = _saved("GPT2LMHeadModel", tmp_path / "gpt2")
    tp2 = plan_model(build_meta_model(folder), tp=2)
    cp2 = plan_model(build_meta_model(folder), tp=2, cp=2, dp=2)
    assert cp2.params == tp2.params and cp2.world == 8  # cp does not split parameters; world = tp x cp x pp x dp
    assert cp2.bytes_per_rank() == plan_model(build_meta_model(folder), tp=2, dp=2).bytes_per_rank()
    assert main(["plan", folder, "--tp", "2", "--cp", "2", "--summary", "--batch", "2", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 x cp=2 (ring) x pp=1 x dp=1 = 4 processes" in out
    assert "batch 2 x seq 16, the sequence split over cp=2 (ring)" in out and "tensor + context par." in out
    assert (
        main(["plan", folder, "--cp", "2", "--cp-mode", "all_to_all", "--summary", "--batch", "2", "--seq", "16"]) == 0
    )
    assert "split over cp=2 (all_to_all)" in capsys.readouterr().out
    assert main(["plan", folder, "--cp", "2", "--pp", "2", "--summary", "--batch", "2", "--seq", "16"]) == 0
    out = capsys.readouterr().out  # ParallelEngine trains cp with pipeline stages
    assert "cp=2 (ring) x pp=2 x dp=1 = 4 processes" in out and "seq 16, the sequence split over cp=2 (ring)" in out
    for argv, message in [
        (["--tp", "2", "--cp", "4", "--cp-mode", "all_to_all"], "4 heads, which tensor_parallel_size=2 x context_"),
        (["--cp", "0"], "context_parallel_size=0"),
        (["--cp", "2", "--simulate"], "--simulate takes no --policy or --cp"),
    ]:
        assert main(["plan", folder, *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    bert = _saved("BertForMaskedLM", tmp_path / "bert")
    assert main(["plan", bert, "--cp", "2"]) == 2
    assert "BertForMaskedLM cannot be split over the sequence" in capsys.readouterr().err


def test_plan_splits_an_encoder_decoder_over_four_stages(tmp_path):
    """T5 at pp=4, one layer per stage: the shared embedding is held by the encoder's first stage, the decoder's
    first stage and the head's; the encoder's final norm by the stage of its last layer."""
    cls = tf.T5ForConditionalGeneration
    model = cls(tiny_config(cls.config_class, num_layers=2, num_decoder_layers=2))
    model.save_pretrained(tmp_path / "t5")
    stages = plan_model(build_meta_model(str(tmp_path / "t5")), pp=4).stages
    assert [list(layers) for layers, _ in stages] == [[0], [1], [2], [3]]
    size = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    embedding, norm = size(model.shared), size(model.encoder.final_layer_norm)
    blocks = [*model.encoder.block, *model.decoder.block]
    assert [n for _, n in stages] == [
        size(blocks[0]) + embedding,
        size(blocks[1]) + norm,
        size(blocks[2]) + embedding,
        size(blocks[3]) + norm + embedding,
    ]


def test_cli_plans_hybrid_sharding_as_zero_over_its_shard_group(tmp_path, capsys):
    # --dp-replicate R: ZeRO shards over dp / R ranks, so every byte is the plain plan's at dp / R
    folder = _saved("GPT2LMHeadModel", tmp_path / "gpt2")
    for zero in (1, 3):
        fixed = ["--tp", "2", "--zero", str(zero), "--summary", "--gpu-memory", "1GB"]
        assert main(["plan", folder, *fixed, "--dp", "4", "--dp-replicate", "2"]) == 0
        hybrid = capsys.readouterr().out
        assert main(["plan", folder, *fixed, "--dp", "2"]) == 0
        shard_group = capsys.readouterr().out
        assert "dp=4 (2 replicas x 2 shards) = 8 processes" in hybrid
        # all but the layout line and the world size of the fit's header
        assert hybrid.splitlines()[1:] == shard_group.replace("fits on 4 x", "fits on 8 x").splitlines()[1:]
    assert main(["plan", folder, "--dp", "4", "--dp-replicate", "3"]) == 2
    assert "--dp-replicate=3 does not divide data_parallel_size=4" in capsys.readouterr().err
    assert main(["plan", folder, "--dp", "4", "--ep", "4", "--dp-replicate", "2"]) == 2  # ep inside a shard group
    assert "so ep must divide dp_shard=2" in capsys.readouterr().err
    assert (
        main(["plan", folder, "--gpus", "8", "--gpu-memory", "1GB", "--seq", "8", "--search", "--dp-replicate", "2"])
        == 2
    )
    assert "drop --dp-replicate" in capsys.readouterr().err
    assert main(["plan", folder, "--dp", "4", "--dp-replicate", "2", "--simulate"]) == 2
    assert "--simulate takes no --dp-replicate" in capsys.readouterr().err
