"""ZeRO-3 (EngineConfig(zero_stage=3), PyTorch FSDP2 over the dp ranks) against one process.

Every check trains the engine and, on each rank, the unsharded model from the same weights on the
same global batches (the loss of a step is the mean over the dp x micro-batch chunks, as the engine
defines it), with AdamW and gradient clipping: the losses of every step and the weights afterwards
(dp shards gathered, tp shards merged) must be equal. At tp=2 x dp=2 (4 ranks, one spawn): the
parameter bytes per rank, the HF export loaded by plain from_pretrained, a training checkpoint
resumed at ZeRO-3 and resharded to ZeRO-1 at tp=4 (and back), sequence parallelism with
activation checkpointing and micro-batches, and pp=2 x dp=2 on both pipeline backends. At dp=2 (2 ranks, one spawn): GPT-2 with tied weights,
and bf16 compute from fp32 shards. What stage 3 does not offer is refused up front.
"""

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardformer import EngineConfig, ParallelEngine, ProcessMesh
from shardformer.checkpoint import load_checkpoint, save_checkpoint, save_pretrained
from shardformer.core.comm import CollectiveCounter
from shardformer.core.shard_spec import ShardSpec
from shardformer.data_parallel import ZeroOptimizer
from shardformer.data_parallel.fsdp import check_fully_shardable
from shardformer.engine import split_batch
from shardformer.tensor_parallel.slicer import gather_tensor, shard_spec
from tests.checkpoint.common import remove_dir, shared_dir
from tests.helpers import assert_close, check_table
from tests.pipeline import common
from tests.policies import zoo
from tests.policies.derived_models import transformers_model

GPT2 = "GPT2LMHeadModel"
# Adam divides by the gradient's own size, so rounding noise in a gradient that is 0 in theory (one
# element of this model's gradient is 1e-9 at step 1) becomes a step of up to lr, in ZeRO-1 as in
# ZeRO-3: eps 1e-6 and lr 1e-3 keep such an element within the fp32 weight tolerance (1e-5).
LR, EPS, DECAY, CLIP = 1e-3, 1e-6, 0.1, 0.5
_MESHES = {}


def _mesh(tp, dp, pp=1, dp_replicate=1):
    if (tp, pp, dp, dp_replicate) not in _MESHES:
        _MESHES[(tp, pp, dp, dp_replicate)] = ProcessMesh(tp, pp, dp, dp_replicate_size=dp_replicate)
    return _MESHES[(tp, pp, dp, dp_replicate)]


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=DECAY)


def _schedule(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


class Reference:
    """The unsharded model and AdamW on one process, stepping through the same global batches."""

    def __init__(self, model, chunks, clip=CLIP):
        self.model, self.chunks, self.clip = model.train(), chunks, clip
        self.opt = adamw(model.parameters())
        self.sched = _schedule(self.opt)

    def step(self, batch):
        self.opt.zero_grad()
        loss = sum(self.model(**p).loss for p in split_batch(batch, self.chunks, "chunks")) / self.chunks
        loss.backward()
        if self.clip is not None:
            self.norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip).item()
        self.opt.step()
        self.sched.step()
        return loss.item()


def _engine(model, tp, dp, zero_stage=3, **options):
    cfg = EngineConfig(tp=tp, dp=dp, zero_stage=zero_stage, max_grad_norm=CLIP, **options)
    engine = ParallelEngine(model, adamw, cfg, mesh=_mesh(tp, dp, cfg.pp, cfg.dp_replicate))
    return engine, _schedule(engine.optimizer)


def _train(engine, sched, batches):
    losses = []
    for batch in batches:
        losses.append(engine.train_step(batch))
        sched.step()
    return losses


def full_weights(model, tp_group):
    """{name: full tensor}: dp shards gathered (DTensor.full_tensor), then tp shards merged."""
    out = {}
    for name, p in model.named_parameters():
        value = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        spec = shard_spec(p)
        out[name] = (value if spec is None else gather_tensor(value, spec, tp_group)).float()
    return out


def _assert_weights(engine, ref, what):
    got = full_weights(engine.model, engine.mesh.tp_group)
    expected = dict(ref.named_parameters())
    if engine.mesh.pp_size == 1:  # a pipeline stage holds some of them (the export checks the whole)
        assert set(got) == set(expected), f"{what}: {set(got) ^ set(expected)}"
    assert got and set(got) <= set(expected), f"{what}: {set(got) - set(expected)}"
    for name, value in got.items():
        assert_close(value, expected[name].detach(), what=f"{what}: {name}")


def _twins(name):
    """The unsharded reference and the model to shard, equal weights: the zoo's saved-and-loaded pair,
    or (another family) a tiny random ``transformers.<name>`` and its copy."""
    if name in (GPT2, "BertForMaskedLM"):
        return common.models(name)
    model = transformers_model(name)
    return copy.deepcopy(model), model


def _trained(name, tp, dp, steps, **options):
    """(engine, scheduler, reference, batches) after ``steps`` steps, losses checked on the way."""
    ref, model = _twins(name)
    batches = common.batches(name, steps + 3)
    for b in batches:  # every label counts: the loss (a mean of chunk means) is the same for any dp
        b["labels"] = b["input_ids"].clone()
    engine, sched = _engine(model, tp, dp, **options)
    reference = Reference(ref, dp * options.get("num_microbatches", 1))  # the engine's loss: a mean of chunks
    expected = [reference.step(b) for b in batches[:steps]]
    got = _train(engine, sched, batches[:steps])
    assert_close(torch.tensor(got), torch.tensor(expected), what=f"{name} tp={tp} dp={dp} {options}: losses")
    # the global norm over tp x dp (x pp) is the unsharded model's, and large enough that clipping acts
    assert_close(torch.tensor(engine.last_grad_norm), torch.tensor(reference.norm), what="gradient norm")
    assert reference.norm > CLIP, reference.norm
    _assert_weights(engine, ref, f"{name} tp={tp} dp={dp} {options}: weights after {steps} steps")
    return engine, sched, reference, batches


def _parameter_bytes_halved(engine):
    """Every parameter and gradient is a dp shard: this rank holds about 1/dp of its tp shard."""
    tp_local = local = 0
    for p in engine.model.parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), type(p)
        tp_local += p.numel() * p.element_size()  # a DTensor's shape is the whole (tp-local) tensor
        local += p.to_local().numel() * p.element_size()
        assert p.grad.to_local().shape == p.to_local().shape
    assert local / tp_local <= 0.52, local / tp_local


def _export_matches(engine, ref):
    path = shared_dir("sf-zero3-export-")
    save_pretrained(engine.model, path)
    if dist.get_rank() == 0:
        plain = tf.GPT2LMHeadModel.from_pretrained(path, attn_implementation="eager")
        state = plain.state_dict()
        for name, value in ref.state_dict().items():
            assert_close(state[name], value, what=f"exported {name}")
    remove_dir(path)


def check_tp2_dp2_parity_export_and_checkpoints():
    engine, sched, reference, batches = _trained(GPT2, 2, 2, 3)
    _parameter_bytes_halved(engine)
    _export_matches(engine, reference.model)
    path = shared_dir("sf-zero3-ckpt-")
    ckpt = os.path.join(path, "zero3")
    save_checkpoint(ckpt, engine.model, engine.optimizer, sched, step=3)
    expected = [reference.step(b) for b in batches[3:]]

    # resumed at the same layout, from other weights
    _, fresh = common.models(GPT2)
    torch.nn.init.normal_(fresh.transformer.h[0].mlp.c_fc.weight)
    resumed, sched2 = _engine(fresh, 2, 2)
    assert load_checkpoint(ckpt, resumed.model, resumed.optimizer, sched2)["rng_restored"]
    assert_close(torch.tensor(_train(resumed, sched2, batches[3:])), torch.tensor(expected), what="resumed losses")
    _assert_weights(resumed, reference.model, "resumed ZeRO-3: weights")

    # resharded: ZeRO-3 tp=2 x dp=2 -> ZeRO-1 tp=4, and its checkpoint back into ZeRO-3 tp=2 x dp=2
    _, other = common.models(GPT2)
    zero1, sched1 = _engine(other, 4, 1, zero_stage=1)
    info = load_checkpoint(ckpt, zero1.model, zero1.optimizer, sched1)
    assert info["layout"] == {"tp": 2, "pp": 1, "dp": 2, "world": 4}, info
    assert isinstance(zero1.optimizer, ZeroOptimizer)
    assert_close(torch.tensor(_train(zero1, sched1, batches[3:4])), torch.tensor(expected[:1]), what="ZeRO-1 tp=4")
    back = os.path.join(path, "zero1")
    save_checkpoint(back, zero1.model, zero1.optimizer, sched1, step=4)
    _, again = common.models(GPT2)
    zero3, sched3 = _engine(again, 2, 2)
    load_checkpoint(back, zero3.model, zero3.optimizer, sched3)
    assert_close(torch.tensor(_train(zero3, sched3, batches[4:])), torch.tensor(expected[1:]), what="back to ZeRO-3")
    _assert_weights(zero3, reference.model, "ZeRO-3 -> ZeRO-1 -> ZeRO-3: weights")
    remove_dir(path)


def _on_dp(counter, engine, op):
    """``(calls, bytes)`` of collective ``op`` over the engine's dp group that ``counter`` saw."""
    dp = engine.mesh.dp_group.group_name
    found = [b for (kind, _, b), g in zip(counter.calls, counter.groups) if kind == op and
             getattr(g, "group_name", None) == dp]  # fmt: skip
    return len(found), sum(found)


def _assert_one_reduce_scatter_per_unit_and_step(engine, counter, steps):
    """Gradient accumulation: FSDP2 reduce-scatters each unit once per step (in the last micro-batch's
    backward), not once per micro-batch."""
    units = sum(isinstance(m, FSDPModule) for m in engine.model.modules())
    calls, _ = _on_dp(counter, engine, "reduce_scatter")
    assert units > 1 and calls == steps * units, (calls, steps, units)


def _gathered_bytes(params, dp):
    """Bytes of ``params`` gathered over dp (fp32): FSDP2 pads each one's first dimension to a multiple of dp."""
    return sum(-(-p.shape[0] // dp) * dp * math.prod(p.shape[1:]) * 4 for p in params)


def _assert_fsdp_collectives_counted(engine, counter, steps, microbatches):
    """What the counter sees of FSDP2 (through its dispatch mode, none of it twice): per micro-batch each
    layer unit gathered for its forward and again for its backward (the recomputed forward of activation
    checkpointing runs while it is gathered), the root unit (embedding, head) once, kept for its
    backward; per step every unit's fp32 gradients reduce-scattered once."""
    dp = engine.mesh.dp_size
    layers = [m for m in engine.model.modules() if isinstance(m, FSDPModule) and m is not engine.model]
    in_layers = [p for m in layers for p in m.parameters()]
    root = [p for p in engine.model.parameters() if all(p is not q for q in in_layers)]
    everything = _gathered_bytes(engine.model.parameters(), dp)
    gathers = microbatches * (2 * _gathered_bytes(in_layers, dp) + _gathered_bytes(root, dp))
    assert _on_dp(counter, engine, "all_gather") == (steps * microbatches * (2 * len(layers) + 1), steps * gathers)
    assert _on_dp(counter, engine, "reduce_scatter") == (steps * (len(layers) + 1), steps * everything)


def check_tp2_dp2_sequence_parallel_checkpointing_microbatches():
    with CollectiveCounter() as counter:
        engine, *_ = _trained(
            GPT2, 2, 2, 2, sequence_parallel=True, activation_checkpointing=True, num_microbatches=2
        )  # fmt: skip
    _assert_one_reduce_scatter_per_unit_and_step(engine, counter, 2)
    _assert_fsdp_collectives_counted(engine, counter, 2, 2)


def check_tp2_dp2_models_without_a_stage_forward():
    """A plan-route Llama and a derived OPT at pp=1: the engine runs the model's own forward, which is
    the call of the FSDP2 root itself (installing it as the root's forward recursed forever)."""
    for name in ("LlamaForCausalLM", "OPTForCausalLM"):
        _trained(name, 2, 2, 2)


def check_pp2_dp2_both_backends_and_export():
    """Pipeline stages of FSDP2 units: the tied embedding's dp shards summed over the first and last
    stage, the gradient norm over pp x dp, on torch's schedules and on our send/recv; each stage's
    units reduce-scattered once per step of 2 micro-batches; torch's sends counted."""
    for backend, schedule in (("torch", "1f1b"), ("p2p", "gpipe"), ("p2p", "1f1b")):
        with CollectiveCounter() as counter:
            engine, _, reference, _ = _trained(
                GPT2, 1, 2, 3, pp=2, num_microbatches=2, backend=backend, schedule=schedule
            )  # fmt: skip
        _assert_one_reduce_scatter_per_unit_and_step(engine, counter, 3)
        if backend == "torch":  # torch's schedule sends itself: counted too, one activation (or its gradient) each
            with CollectiveCounter() as counter:
                engine.train_step(common.batches(GPT2, 1, seed=1)[0])
            pp = engine.mesh.pp_group
            sends = [n for (op, n, _), g in zip(counter.calls, counter.groups) if op == "send" and g is pp]
            activation = common.BATCH // 2 // 2 * zoo.SEQ * engine.model.config.n_embd  # dp 2, 2 micro-batches
            assert sends.count(activation) == 2, (sends, activation)
    _export_matches(engine, reference.model)


test_zero3_world4 = check_table(
    [
        check_tp2_dp2_parity_export_and_checkpoints,
        check_tp2_dp2_sequence_parallel_checkpointing_microbatches,
        check_tp2_dp2_models_without_a_stage_forward,
        check_pp2_dp2_both_backends_and_export,
    ],
    4,
)


def _assert_full_optimizer_state(engine, reference):
    """``optimizer.state_dict()`` is the full state: the reference AdamW's, parameter by parameter."""
    full = engine.optimizer.state_dict()
    names = [n for n, _ in engine.model.named_parameters()]
    ref_index = {n: i for i, (n, _) in enumerate(reference.model.named_parameters())}
    ref_state = reference.opt.state_dict()["state"]
    assert sorted(full["state"]) == list(range(len(names)))
    for index, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            got, expected = full["state"][index][key], ref_state[ref_index[name]][key]
            assert not isinstance(got, DTensor) and got.shape == expected.shape, (name, key)
            assert_close(got, expected, atol=1e-7, what=f"full optimizer state {key} of {name}")


def check_dp2_parity_eval_step_and_reshard():
    engine, sched, reference, batches = _trained(GPT2, 1, 2, 3)
    _assert_full_optimizer_state(engine, reference)
    with torch.no_grad():
        parts = split_batch(batches[3], 2, "chunks")
        expected = sum(reference.model.eval()(**p).loss for p in parts).item() / 2
    assert_close(torch.tensor(engine.eval_step(batches[3])), torch.tensor(expected), what="eval_step")
    # the vocabulary (99 rows, no tp padding) splits unevenly over dp: 50 + 49 rows of wte and its states
    assert engine.model.transformer.wte.weight.to_local().shape[0] == (50 if dist.get_rank() == 0 else 49)
    path = shared_dir("sf-zero3-ckpt-")
    save_checkpoint(path, engine.model, engine.optimizer, sched, step=3)
    reference.model.train()
    expected = [reference.step(b) for b in batches[3:]]
    _, other = common.models(GPT2)
    zero1, sched1 = _engine(other, 2, 1, zero_stage=1)  # ZeRO-3 dp=2 -> ZeRO-1 tp=2
    load_checkpoint(path, zero1.model, zero1.optimizer, sched1)
    assert_close(torch.tensor(_train(zero1, sched1, batches[3:])), torch.tensor(expected), what="ZeRO-1 tp=2")
    _assert_weights(zero1, reference.model, "ZeRO-3 dp=2 -> ZeRO-1 tp=2: weights")
    remove_dir(path)


def check_dp2_models_without_a_stage_forward():
    """As at tp=2 x dp=2, and the eval step (no backward) leaves the root's weights resharded."""
    for name in ("LlamaForCausalLM", "OPTForCausalLM"):
        engine, _, reference, batches = _trained(name, 1, 2, 2)
        with torch.no_grad():
            parts = split_batch(batches[2], 2, "chunks")
            expected = sum(reference.model.eval()(**p).loss for p in parts).item() / 2
        assert_close(torch.tensor(engine.eval_step(batches[2])), torch.tensor(expected), what=f"{name} eval_step")
        assert all(isinstance(p, DTensor) for p in engine.model.parameters())


def check_dp2_bf16_compute_from_fp32_shards():
    ref, model = common.models("BertForMaskedLM")
    batch = common.batches("BertForMaskedLM", 1)[0]
    engine, _ = _engine(model, 1, 2, precision="bf16")
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # the sharded masters
    loss = engine.train_step(batch)
    expected = Reference(ref, 2).step(batch)
    assert abs(loss - expected) < 2e-2 * abs(expected), (loss, expected)  # bf16 compute: ~3 significant digits
    assert loss != expected  # it did compute in bf16
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in engine.model.parameters())


def check_dp2_scalar_parameters_kept_whole():
    """CLIP's ``logit_scale`` is 0-dim, which FSDP2 cannot shard: kept whole on each rank, its gradient
    averaged over dp; losses, the clipped norm and every weight after AdamW steps as one process."""
    ref, model = _twins("CLIPModel")
    g = torch.Generator().manual_seed(0)
    size = model.config.vision_config.image_size
    batches = [
        {"input_ids": torch.randint(3, 99, (4, 8), generator=g), "pixel_values": torch.randn(4, 3, size, size,
         generator=g), "return_loss": True}
        for _ in range(3)
    ]  # fmt: skip
    engine, sched = _engine(model, 1, 2)
    assert not isinstance(engine.model.logit_scale, DTensor) and engine.model.logit_scale.dim() == 0
    reference = Reference(ref, 2)
    expected = [reference.step(b) for b in batches[:2]]
    assert_close(torch.tensor(_train(engine, sched, batches[:2])), torch.tensor(expected), what="CLIP losses")
    assert_close(torch.tensor(engine.last_grad_norm), torch.tensor(reference.norm), what="CLIP gradient norm")
    expected.append(reference.step(batches[2]))
    path = shared_dir("sf-zero3-scalar-")  # resumed from a checkpoint: the scalar's Adam state too
    save_checkpoint(path, engine.model, engine.optimizer, sched, step=2)
    resumed, sched2 = _engine(_twins("CLIPModel")[1], 1, 2)
    load_checkpoint(path, resumed.model, resumed.optimizer, sched2)
    assert_close(torch.tensor(_train(resumed, sched2, batches[2:])), torch.tensor(expected[2:]), what="resumed")
    _assert_weights(resumed, ref, "CLIP weights after 3 steps")
    remove_dir(path)


test_zero3_dp2 = check_table(
    [
        check_dp2_scalar_parameters_kept_whole,
        check_dp2_parity_eval_step_and_reshard,
        check_dp2_models_without_a_stage_forward,
        check_dp2_bf16_compute_from_fp32_shards,
    ],
    2,
)


@pytest.mark.parametrize(
    ("options", "named"),
    [({"precision": "fp16"}, "precision='fp16'"), ({"compile": True}, "compile=True"), ({"cp": 2}, "cp=2")],
)
def test_zero3_refuses_what_it_does_not_offer(options, named):
    with pytest.raises(ValueError, match=f"EngineConfig.{named} with zero_stage=3"):
        EngineConfig(zero_stage=3, **options)


def test_zero_optimizer_points_stage3_to_fsdp2():
    with pytest.raises(ValueError, match="EngineConfig\\(zero_stage=3\\)"):
        ZeroOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), stage=3)


def test_fully_shard_refuses_replicated_kv_heads_and_half_precision():
    layer = torch.nn.Linear(4, 8)
    # 2 key/value blocks of 2 rows each cut into 1 piece per block: held whole by both tp ranks
    layer.weight.shard_spec = ShardSpec(
        dim=0, world_size=2, rank=0, full_size=4, padded_size=4, n_cast=2, splits=(1, 1)
    )
    with pytest.raises(ValueError, match="weight holds key/value heads replicated over 2 tensor-parallel ranks"):
        check_fully_shardable(layer)
    with pytest.raises(ValueError, match="weight is torch.bfloat16; the sharded parameters are the fp32 master"):
        check_fully_shardable(torch.nn.Linear(4, 4).to(torch.bfloat16))
    check_fully_shardable(torch.nn.Linear(4, 4))  # a plain fp32 module is fine
