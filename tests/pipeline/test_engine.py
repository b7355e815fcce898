"""ParallelEngine on 4 gloo ranks: every (tp, pp, dp) combination with ZeRO stage 1, for GPT-2 LM,
BERT MLM, ViT classification (and timm ViT): the loss of every step and the weights after 3 steps
equal one process training the unsharded model on the same batches. One spawn for everything.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from shardformer import EngineConfig, ParallelEngine, ProcessMesh
from shardformer.pipeline import stage_of
from shardformer.pipeline.schedule import run_pipeline
from tests.helpers import assert_close, check_table
from tests.pipeline import common
from tests.policies import zoo

STEPS = 3
# (tp, pp, dp, schedule, micro-batches, max grad norm, backend): both schedules on both backends
# (torch.distributed.pipelining and our send/recv), gradient accumulation, clipping
COMBOS = [
    (2, 2, 1, "1f1b", 2, 0.5, "torch"),
    (1, 2, 2, "gpipe", 2, None, "p2p"),
    (2, 1, 2, "1f1b", 2, 0.5, "torch"),
    (1, 4, 1, "1f1b", 4, 0.5, "p2p"),
    (4, 1, 1, "gpipe", 1, None, "torch"),
    (1, 1, 4, "1f1b", 2, 0.5, "torch"),
]
_MESHES = {}


def _mesh(tp, pp, dp):
    if (tp, pp, dp) not in _MESHES:
        _MESHES[(tp, pp, dp)] = ProcessMesh(tp, pp, dp)
    return _MESHES[(tp, pp, dp)]


def _check(
    name,
    tp,
    pp,
    dp,
    schedule,
    micro,
    clip,
    backend="torch",
    zero_stage=1,
    model_pair=None,
    loss_fn=None,
    data=None,
    optimizer=common.sgd,
    **engine_options,
):
    ref, model = model_pair or common.models(name)
    data = data or common.batches(name, STEPS)
    cfg = EngineConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        zero_stage=zero_stage,
        num_microbatches=micro,
        schedule=schedule,
        max_grad_norm=clip,
        backend=backend,
        **engine_options,
    )
    engine = ParallelEngine(model, optimizer, cfg, loss_fn=loss_fn, mesh=_mesh(tp, pp, dp))
    stage = stage_of(engine.model)
    assert stage == (engine.mesh.pp_rank, pp), stage
    expected = common.reference_run(ref, data, dp * micro, clip, loss_fn, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [engine.train_step(b) for b in data]
    # with overlap, every bucket is sent once, in the last micro-batch's backward: none is sent again
    assert not [w for w in caught if "reduced again" in str(w.message)], [str(w.message) for w in caught]
    what = (
        f"{name} tp={tp} pp={pp} dp={dp} {schedule}/{backend} x{micro} clip={clip} zero={zero_stage} {engine_options}"
    )
    assert_close(torch.tensor(got), torch.tensor(expected), what=f"{what}: losses")
    weights, mine = common.gathered_weights(engine.model, engine.mesh.tp_group)
    # a stage without the module that names a tied weight first knows it by another of its names
    canonical = {alias: name for name, p in ref.named_parameters() for alias in common.names_of(ref, p)}
    weights = {canonical.get(k, k): v for k, v in weights.items()}
    mine = {canonical.get(k, k) for k in mine}
    full = dict(ref.named_parameters())
    assert mine <= set(full), f"{what}: names not in the unsharded model: {mine - set(full)}"
    assert set(weights) == set(full), f"{what}: missing on every stage: {set(full) - set(weights)}"
    for key, value in full.items():
        assert_close(weights[key], value.detach(), what=f"{what}: {key} after {len(data)} steps")
    return engine


class _ComboCheck:
    """A picklable check of one model at one combination (spawned ranks unpickle it)."""

    def __init__(self, name, combo):
        self.name, self.combo = name, combo
        tp, pp, dp, schedule, _, _, backend = combo
        self.__name__ = f"check_{name}_tp{tp}_pp{pp}_dp{dp}_{schedule}" + (f"_{backend}" if pp > 1 else "")

    def __call__(self):
        _check(self.name, *self.combo)


def check_gpt2_stage_contents():
    ref, model = common.models("GPT2LMHeadModel")
    engine = ParallelEngine(model, common.sgd, EngineConfig(tp=1, pp=4, num_microbatches=4), mesh=_mesh(1, 4, 1))
    m, stage = engine.model, engine.mesh.pp_rank
    assert stage_of(m) == (stage, 4) and m.shardformer.layers == (stage,)
    assert [i for i, b in enumerate(m.transformer.h) if b is not None] == [stage]
    assert (m.transformer.wte is not None) == (stage in (0, 3))
    assert (m.transformer.wpe is not None) == (stage == 0)
    assert (m.lm_head is not None) == (stage == 3)
    if stage == 3:
        assert m.lm_head.weight is m.transformer.wte.weight  # still tied on the last stage
    # inference under pp: the logits reach every rank and match the unsharded model
    inputs = common.batches("GPT2LMHeadModel", 1)[0]
    inputs.pop("labels")
    with torch.no_grad():
        expected = ref.eval()(**inputs).logits
    assert_close(engine.forward(inputs), expected, what="inference logits under pp=4")
    # a batch of 1 (or one num_microbatches does not divide) runs in fewer micro-batches, same outputs
    assert_close(engine.forward({"input_ids": inputs["input_ids"][:1]}), expected[:1], what="a batch of 1")
    assert_close(engine.forward({"input_ids": inputs["input_ids"][:6]}), expected[:6], what="a batch of 6")
    with pytest.raises(RuntimeError, match=r"generate\(\) on pipeline stage \d of 4: .*pipeline_parallel_size=1"):
        engine.model.generate(inputs["input_ids"][:1, :4], max_new_tokens=2)


def check_eval_step_and_zero2_with_pp():
    name = "BertForMaskedLM"
    ref, model = common.models(name)
    data = common.batches(name, 2, seed=4)
    engine = _check(
        name,
        2,
        2,
        1,
        "gpipe",
        2,
        1.0,
        "torch",
        zero_stage=2,
        model_pair=(ref, model),
        data=data,
        overlap_grad_reduce=False,
    )
    chunks = [dict(zip(data[0], v)) for v in zip(*[t.chunk(2) for t in data[0].values()])]
    with torch.no_grad():
        expected = sum(ref.eval()(**c).loss for c in chunks).item() / 2
    assert_close(torch.tensor(engine.eval_step(data[0])), torch.tensor(expected), what="eval_step")


def check_zero2_pp2_dp2_releases_every_gradient():
    """ZeRO-2 as the engine runs it (gradients released into buckets, buckets freed once reduced) with
    overlap, 2 micro-batches, clipping and GPT-2's embedding tied across the two stages: exact, and
    no full-size gradient is left after the step."""
    engine = _check("GPT2LMHeadModel", 1, 2, 2, "1f1b", 2, 0.5, "p2p", zero_stage=2)
    assert engine.optimizer.reducer.release_grads
    assert all(p.grad is None for p in engine.model.parameters())
    assert engine.optimizer.gradient_bytes()["gradients"] == 0


def check_activation_checkpointing_pp2_tp2():
    engine = _check("GPT2LMHeadModel", 2, 2, 1, "1f1b", 2, 1.0, "torch", activation_checkpointing=True)
    layers = [b for b in engine.model.transformer.h if b is not None]
    assert layers and all(b.gradient_checkpointing for b in layers)


def check_sequence_parallel_gpt2_pp2_tp2_with_checkpointing():
    engine = _check(
        "GPT2LMHeadModel", 2, 2, 1, "gpipe", 2, 0.5, "p2p", activation_checkpointing=True, sequence_parallel=True
    )
    assert engine.model.shardformer.sequence_parallel is not None


def check_inputs_embeds_run_the_models_own_forward_at_pp1_and_are_refused_at_pp2():
    """A batch of inputs_embeds trains as the unsharded model trains on it (pp=1: the model's own
    forward, not the spec's, which embeds input_ids); with input_ids too, or at pp > 1, it is refused."""
    hidden = common.config("GPT2LMHeadModel").n_embd
    g = torch.Generator().manual_seed(5)
    data = [
        {"inputs_embeds": torch.randn(common.BATCH, zoo.SEQ, hidden, generator=g), "labels": b["labels"]}
        for b in common.batches("GPT2LMHeadModel", STEPS)
    ]
    engine = _check("GPT2LMHeadModel", 2, 1, 2, "1f1b", 2, 0.5, "torch", data=data)
    with pytest.raises(ValueError, match="holds both input_ids and inputs_embeds; pass only one"):
        engine.train_step({**data[0], "input_ids": data[0]["labels"].clamp(min=0)})
    _, model = common.models("GPT2LMHeadModel")
    piped = ParallelEngine(model, common.sgd, EngineConfig(tp=2, pp=2), mesh=_mesh(2, 2, 1))
    with pytest.raises(ValueError, match=r"inputs_embeds at pipeline_parallel_size=2: .*pass input_ids"):
        piped.train_step(data[0])
    # the default num_microbatches=1 cannot fill torch's 1F1B over 2 stages: named, with the fix, on every rank
    with pytest.raises(ValueError, match=r"num_microbatches=1 with schedule='1f1b' at pp=2: .*num_microbatches=2"):
        piped.train_step(common.batches("GPT2LMHeadModel", 1)[0])


def check_different_batches_or_a_skipped_step_raise_on_every_rank_before_the_update():
    """tp peers given different batches, or a rank that skipped a batch: every rank raises naming the
    ranks, and the optimizer has not stepped (the check rides in the loss's all-gather)."""
    _, model = common.models("GPT2LMHeadModel")
    engine = ParallelEngine(model, common.sgd, EngineConfig(tp=2, pp=1, dp=2), mesh=_mesh(2, 1, 2))
    data = common.batches("GPT2LMHeadModel", 3, seed=9)
    engine.train_step(data[0])
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    other = {k: v.clone() for k, v in data[1].items()}
    if engine.mesh.tp_rank == 1:  # one token differs on the second tp rank of each group
        other["input_ids"][0, 3] = 3 if other["input_ids"][0, 3] != 3 else 4
    pattern = r"ranks 0, 1, 2, 3 must get the same batch .* at step #2 \(ranks 0, 2; ranks 1, 3 hold one batch each\)"
    with pytest.raises(RuntimeError, match=pattern):
        engine.train_step(other)
    skipped = data[2] if engine.mesh.rank == 3 else data[1]  # rank 3 skipped data[1]
    with pytest.raises(RuntimeError, match=r"must get the same batch .* at step #3 \(ranks 0, 1, 2; ranks 3 hold"):
        engine.train_step(skipped)
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed in a refused step"


def check_resume_at_pp2_with_dropout_under_the_torch_backend_is_exact():
    """Save an engine's model, optimizer and scheduler at step 2; a fresh engine loading it continues
    with the losses of the run that never stopped, with dropout on, under torch.distributed.pipelining
    (whose shape inference at a new stage's first step must not move any RNG)."""
    from shardformer.checkpoint import load_checkpoint, save_checkpoint
    from tests.checkpoint.common import remove_dir, shared_dir

    def build(seed):
        cfg = common.config("GPT2LMHeadModel")
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.2
        torch.manual_seed(seed)
        engine = ParallelEngine(
            tf.GPT2LMHeadModel(cfg), common.sgd, EngineConfig(tp=2, pp=2, num_microbatches=2), mesh=_mesh(2, 2, 1)
        )
        return engine, torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)

    def train(engine, sched, steps):
        out = []
        for batch in steps:
            out.append(engine.train_step(batch))
            sched.step()
        return out

    data = common.batches("GPT2LMHeadModel", 4, seed=3)
    path = shared_dir()
    engine, sched = build(0)
    train(engine, sched, data[:2])
    save_checkpoint(f"{path}/ckpt", engine.model, engine.optimizer, sched, step=2)
    expected = train(engine, sched, data[2:])
    fresh, fresh_sched = build(5)
    torch.manual_seed(77)  # disturb the global RNG: the checkpoint restores it
    load_checkpoint(f"{path}/ckpt", fresh.model, fresh.optimizer, fresh_sched)
    torch.testing.assert_close(train(fresh, fresh_sched, data[2:]), expected, atol=1e-6, rtol=0)
    remove_dir(path)


def _timm_loss(logits, batch):
    return F.cross_entropy(logits, batch["labels"])


def check_timm_vit_pp2_tp2():
    pair = zoo.timm_pair()
    g = torch.Generator().manual_seed(7)
    data = [
        {
            "x": torch.randn(common.BATCH, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 3, (common.BATCH,), generator=g),
        }
        for _ in range(STEPS)
    ]
    _check(
        "timm_vit", 2, 2, 1, "1f1b", 2, 0.5, "p2p", model_pair=pair, loss_fn=_timm_loss, data=data, overlap_p2p=False
    )


def _one_output_per_size(model, hidden, micro_batch):
    return torch.ones(micro_batch["rows"], 3) if hidden is None else hidden.sum()


def check_p2p_overlap_refuses_micro_batches_of_two_shapes():
    """Early receives assume the step's first shape: a different one fails on both stages, no hang."""
    mesh = ProcessMesh(1, 2, 2)  # its own groups: nothing of this step is left in a group others use
    micro = [{"rows": 1}, {"rows": 2}]
    with pytest.raises(ValueError, match=r"shape \[2, 3\] for micro-batch 1.*EngineConfig\(overlap_p2p=False\)"):
        run_pipeline(None, _one_output_per_size, mesh, micro, None, backward=False)
    # without early receives each shape travels with its tensor
    run_pipeline(None, _one_output_per_size, mesh, micro, None, backward=False, overlap=False)


# every layout on GPT-2; two on BERT and ViT (another family's stage split, the other backend)
CHECKS = (
    [_ComboCheck("GPT2LMHeadModel", combo) for combo in COMBOS]
    + [_ComboCheck(name, combo) for name in ("BertForMaskedLM", "ViTForImageClassification") for combo in COMBOS[:2]]
    + [
        _ComboCheck("BertForMaskedLM", (1, 4, 1, "gpipe", 4, 0.5, "torch")),
        check_gpt2_stage_contents,
        check_eval_step_and_zero2_with_pp,
        check_zero2_pp2_dp2_releases_every_gradient,
        check_activation_checkpointing_pp2_tp2,
        check_sequence_parallel_gpt2_pp2_tp2_with_checkpointing,
        check_timm_vit_pp2_tp2,
        check_inputs_embeds_run_the_models_own_forward_at_pp1_and_are_refused_at_pp2,
        check_different_batches_or_a_skipped_step_raise_on_every_rank_before_the_update,
        check_p2p_overlap_refuses_micro_batches_of_two_shapes,
        check_resume_at_pp2_with_dropout_under_the_torch_backend_is_exact,
    ]
)

test_engine_4_ranks = check_table(CHECKS, 4)
