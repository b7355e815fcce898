"""Every route is proven before it cuts the user's model.

A tp plan that is shape-consistent but wrong (a fused ``[Q | K | V]`` projection cut as plain columns,
injected from outside by hiding the plan route's fused-block detection: the kind of mistake
transformers 5.24's CodeGen plan exposed) is rejected by the proof and the derived route, proven,
takes over; chosen explicitly it is refused naming the first diverging module. The record names the
route, verdicts are cached per library version, and ``prove=False`` is explicit and warned about.
"""

from __future__ import annotations

import copy
import logging

import torch
import transformers as tf

from shardformer.core.tiny import tiny_config
from shardformer.tools.testing import run_on_ranks


def _phi3(plain_qkv: bool = False):
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(tiny_config(tf.Phi3Config)).eval()
    if plain_qkv:  # a plan changed by hand: the fused [Q | K | V] split over the ranks, not gathered
        plan = {"model.layers.*.self_attn.qkv_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
        model.tp_plan = {**model.tp_plan, **plan}
    return model


def _loss_and_grads(model, ref, ids):
    from shardformer.core.compare import compare_params
    from shardformer.core.record import sharding_of

    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    loss = abs(model(input_ids=ids, labels=ids).loss.item() - ref(input_ids=ids, labels=ids).loss.item())
    bad = [d.name for d in compare_params(ref, model, sharding_of(model).tp_group, grads=True) if not d.ok]
    return loss, bad


def _ranks():
    import pytest
    import transformers

    from shardformer import ShardConfig, shard_model
    from shardformer.policies import proof
    from shardformer.policies.derived import NotProvenError
    from shardformer.policies.tp_plan import TpPlanPolicy, heads

    out = {}
    ids = torch.randint(0, 99, (2, 8), generator=torch.Generator().manual_seed(1))
    cfg = ShardConfig(tensor_parallel_size=2)
    # the right plan: proven and used
    model = _phi3()
    ref = copy.deepcopy(model)
    shard_model(model, cfg)
    out["right"] = (model.shardformer.route, model.shardformer.proven, *_loss_and_grads(model, ref, ids))
    model = _phi3(plain_qkv=True)  # the plan route cuts [Q | K | V] block by block: still exact
    ref = copy.deepcopy(model)
    shard_model(model, cfg)
    out["by hand"] = (model.shardformer.route, model.shardformer.proven, *_loss_and_grads(model, ref, ids))

    # a wrong cut: the same plan with the fused blocks unseen, [Q | K | V] cut as plain columns (rank 0
    # gets Q and half of K): shape-consistent, and wrong
    real = heads.fused_blocks
    heads.fused_blocks = lambda *args: None
    proof._VERDICTS.clear()  # the verdict on the real code, cached above, is not this code's
    try:
        model = _phi3(plain_qkv=True)
        ref = copy.deepcopy(model)
        shard_model(model, cfg)
        out["wrong"] = (model.shardformer.route, model.shardformer.proven, *_loss_and_grads(model, ref, ids))
        with pytest.raises(NotProvenError) as refused:
            shard_model(
                _phi3(plain_qkv=True), cfg, TpPlanPolicy()
            )  # the plan route chosen by hand: refused, not replaced
        out["refused"] = str(refused.value)
        # prove=False: the first route that resolves, unproven, with a warning
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("shardformer").addHandler(handler)
        model = _phi3(plain_qkv=True)
        ref = copy.deepcopy(model)
        shard_model(model, ShardConfig(tensor_parallel_size=2, prove=False))
        logging.getLogger("shardformer").removeHandler(handler)
        warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        out["unproven"] = (model.shardformer.route, model.shardformer.proven, warned, _loss_and_grads(model, ref, ids))
    finally:
        heads.fused_blocks = real
        proof._VERDICTS.clear()

    # a plan for the attention only (by hand) would leave every MLP whole: the derived cut goes first
    llama = tf.LlamaForCausalLM(tiny_config(tf.LlamaConfig)).eval()
    llama.tp_plan = {k: v for k, v in llama.tp_plan.items() if ".mlp." not in k}
    ref = copy.deepcopy(llama)
    shard_model(llama, cfg)
    out["partial"] = (llama.shardformer.route, *_loss_and_grads(llama, ref, ids))

    # sharded for inference (under no_grad / inference_mode): the proof still runs the training path
    with torch.no_grad():
        gpt2 = shard_model(tf.GPT2LMHeadModel(tiny_config(tf.GPT2Config)), cfg)
    with torch.inference_mode():
        bert = shard_model(tf.BertForMaskedLM(tiny_config(tf.BertConfig)), cfg)
    out["no grad"] = [(m.shardformer.route, m.shardformer.proven) for m in (gpt2, bert)]

    # verdicts are cached per library version: a new transformers release proves again
    calls = []
    real_prove = proof._prove
    proof._prove = lambda *a: calls.append(1) or real_prove(*a)
    real_version = transformers.__version__
    try:
        shard_model(_phi3(), cfg)  # proven once
        shard_model(_phi3(), cfg)  # cached: no new proof
        transformers.__version__ = "99.0.0"
        shard_model(_phi3(), cfg)
    finally:
        proof._prove, transformers.__version__ = real_prove, real_version
    out["proofs"] = len(calls)
    return out


def test_every_route_is_proven_and_a_wrong_plan_gives_way():
    for out in run_on_ranks(_ranks, 2):
        route, proven, loss, bad = out["right"]
        assert (route, proven) == ("tp plan", True) and loss < 1e-5 and bad == [], out["right"]
        route, proven, loss, bad = out["by hand"]
        assert (route, proven) == ("tp plan", True) and loss < 1e-5 and bad == [], out["by hand"]
        route, proven, loss, bad = out["wrong"]
        assert (route, proven) == ("derived", True) and loss < 1e-5 and bad == [], out["wrong"]
        refused = out["refused"]
        assert "tp plan: not exact on a tiny copy at tensor_parallel_size=2" in refused, refused
        assert "first diverging module: model.layers.0.self_attn" in refused, refused
        route, proven, warned, (loss, bad) = out["unproven"]
        assert (route, proven) == ("tp plan", False), out["unproven"]
        assert loss > 1e-3 and bad, out["unproven"]  # what the proof protects from
        assert any("WITHOUT proof" in w and "prove=False" in w for w in warned), warned
        assert out["proofs"] == 2, out["proofs"]
        assert out["no grad"] == [("built-in policy", True)] * 2, out["no grad"]
        route, loss, bad = out["partial"]
        assert route == "derived" and loss < 1e-5 and bad == [], out["partial"]


def test_routes_are_tried_in_order():
    from shardformer.policies.routes import candidate_routes

    gpt2 = tf.GPT2LMHeadModel(tiny_config(tf.GPT2Config))
    llama = tf.LlamaForCausalLM(tiny_config(tf.LlamaConfig))
    opt = tf.OPTForCausalLM(tiny_config(tf.OPTConfig))
    assert [r.name for r in candidate_routes(gpt2)] == ["built-in policy", "derived"]
    assert [r.name for r in candidate_routes(llama)] == ["tp plan", "derived"]
    assert [r.name for r in candidate_routes(opt)] == ["derived"]
    moe = tf.Qwen2MoeForCausalLM(tiny_config(tf.Qwen2MoeConfig))  # its plan leaves the shared expert whole,
    assert [r.name for r in candidate_routes(moe)] == ["tp plan", "derived"]  # but only it cuts the experts


def test_the_module_a_sharded_copy_fails_in_is_named():
    """A proof whose sharded copy raises names the innermost module running (NeoMME's, Udop's attention
    adding a bias of all the heads to this rank's), not only the error; a module whose code caught an
    error inside it is off the list once it returns."""
    import pytest

    from shardformer.policies.proof import _running

    class Fails(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("heads differ")

    class Catches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Fails()

        def forward(self, x):
            try:
                return self.inner(x)
            except RuntimeError:
                return x

    model = torch.nn.Sequential(Catches(), torch.nn.Sequential(torch.nn.Linear(2, 2), Fails()))
    with pytest.raises(RuntimeError), _running(model) as running:
        model(torch.ones(1, 2))
    assert running == ["", "1", "1.1"]
