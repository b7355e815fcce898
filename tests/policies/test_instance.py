"""The proof covers the model the user runs, not a copy rebuilt from its class.

A module swapped in, hooks registered, a method patched on one instance, an attention implementation
chosen at load time: each is either proven exact at tp=2 (outputs, loss and every gradient against
the unsharded model built from the same weights) or refused before the first step, naming why. A
verdict cached for a clean instance never covers a changed instance of the same class.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn as nn
import transformers as tf

from shardformer.core.instance import CannotReproduce, study_instance
from shardformer.core.tiny import tiny_config
from shardformer.core.tiny_run import tiny_copy
from shardformer.tools.testing import run_on_ranks


def _llama(layers: int = 3):
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tiny_config(tf.LlamaConfig, num_hidden_layers=layers)).eval()


class NormedMLP(nn.Module):
    """The same projections as Llama's MLP, with an RMS normalisation of the intermediate activation:
    a cut of the intermediate width normalises each rank's part alone."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        h = nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))


class SizedMLP(NormedMLP):
    """The same, built from widths (a constructor the proof cannot call with a config)."""

    def __init__(self, hidden: int, inner: int):
        nn.Module.__init__(self)
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)


def _rms_input(module, args):
    (x,) = args
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),)


def _outcome(model, make_ref, cfg, *, labels=True):
    """``("refused", message)`` or ``(route, proven, largest output/loss/gradient error)`` of ``model``
    sharded at ``cfg`` against the unsharded model built from the same weights."""
    from shardformer import shard_model
    from shardformer.core.compare import compare_params
    from shardformer.core.record import sharding_of
    from shardformer.tensor_parallel.regions import gather_from_parallel

    ref = make_ref(model)
    try:
        shard_model(model, cfg)
    except (ValueError, NotImplementedError) as e:
        return ("refused", str(e))
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids} if labels else {"ids": ids % 50}
    out, want = model(**kwargs), ref(**kwargs)
    loss, ref_loss = (out.loss, want.loss) if labels else (out.sum(), want.sum())
    loss.backward(), ref_loss.backward()
    logits, want_logits = (out.logits, want.logits) if labels else (out, want)
    if logits.shape != want_logits.shape:  # vocab-parallel logits
        logits = gather_from_parallel(logits, sharding_of(model).tp_group, want_logits.shape[-1])
    err = max((logits - want_logits).abs().max().item(), (loss - ref_loss).abs().item())
    diffs = compare_params(ref, model, sharding_of(model).tp_group, grads=True)
    err = max([err] + [d.error for d in diffs if d.error is not None] + [1.0 for d in diffs if not d.ok])
    return (model.shardformer.route, model.shardformer.proven, err)


class Plain(nn.Module):
    """A plain module with repeated blocks (no transformers config: its copies are itself, cut)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return x


def _normalised_middle(self, x):  # a forward patched on one instance's block
    h = self[1](self[0](x))
    return self[2](h / h.norm(dim=-1, keepdim=True))


def _ranks():
    from shardformer import ShardConfig

    cfg = ShardConfig(tensor_parallel_size=2)
    deep = copy.deepcopy
    out = {}
    out["clean"] = _outcome(_llama(), deep, cfg)

    swapped = _llama()
    for layer in swapped.model.layers:
        layer.mlp = NormedMLP(swapped.config)
    out["swapped"] = _outcome(swapped, deep, cfg)

    sized = _llama()
    sized.model.layers[2].mlp = SizedMLP(sized.config.hidden_size, sized.config.intermediate_size)
    out["sized, one layer"] = _outcome(sized, deep, cfg)

    hooked = _llama()
    for layer in hooked.model.layers:
        layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        layer.self_attn.o_proj.register_forward_hook(lambda m, args, o: o * 0.5)
    out["exact hooks"] = _outcome(hooked, deep, cfg)
    out["hooks kept"] = [len(layer.mlp.down_proj._forward_pre_hooks) for layer in hooked.model.layers]

    rms = _llama()
    rms.model.layers[1].mlp.down_proj.register_forward_pre_hook(_rms_input)
    out["rms hook"] = _outcome(rms, deep, cfg)

    patched = _llama()  # the same class as "clean", proven above: the cached verdict must not cover it
    mlp = patched.model.layers[0].mlp
    mlp.forward = types.MethodType(NormedMLP.forward, mlp)
    out["patched method"] = _outcome(patched, deep, cfg)

    forwarded = _llama()
    proj = forwarded.model.layers[0].mlp.down_proj
    proj.forward = types.MethodType(lambda self, x: nn.functional.linear(2 * x, self.weight), proj)
    out["patched replaced"] = _outcome(forwarded, deep, cfg)

    weight_hook = _llama()
    weight_hook.model.layers[0].mlp.up_proj.weight.register_hook(lambda g: g * 0)
    out["weight hook"] = _outcome(weight_hook, deep, cfg)

    falcon_cfg = tiny_config(tf.FalconConfig, alibi=True, new_decoder_architecture=False, multi_query=False)
    torch.manual_seed(0)
    falcon = tf.FalconForCausalLM._from_config(falcon_cfg, attn_implementation="eager").eval()
    out["falcon eager"] = _outcome(falcon, deep, cfg)

    from shardformer import shard_model

    switched = shard_model(_llama(), cfg)  # proven with sdpa, then switched to eager: refused at the forward
    switched.set_attn_implementation("eager")
    try:
        switched(input_ids=torch.ones(1, 4, dtype=torch.long))
        out["switched"] = "ran"
    except ValueError as e:
        out["switched"] = str(e)

    plain_cfg = ShardConfig(tensor_parallel_size=2)
    torch.manual_seed(0)
    out["plain clean"] = _outcome(Plain(), deep, plain_cfg, labels=False)
    torch.manual_seed(0)
    plain = Plain()
    plain.blocks[2].forward = types.MethodType(_normalised_middle, plain.blocks[2])
    out["plain patched"] = _outcome(plain, deep, plain_cfg, labels=False)
    return out


def _exact_or_refused(outcome, what):
    if outcome[0] == "refused":
        return
    route, proven, err = outcome
    assert proven and err < 1e-4, f"{what}: {outcome}"


def test_the_proof_runs_the_instance():
    for out in run_on_ranks(_ranks, 2):
        assert out["clean"][:2] == ("tp plan", True) and out["clean"][2] < 1e-4, out["clean"]
        for what in ("swapped", "sized, one layer", "rms hook", "patched method", "plain patched"):
            _exact_or_refused(out[what], what)
        # a cut that keeps these hooks exact: used, with the hooks on the parallel layers
        route, proven, err = out["exact hooks"]
        assert proven and err < 1e-4, out["exact hooks"]
        assert out["hooks kept"] == [1, 1, 1], out["hooks kept"]
        refused, message = out["patched replaced"]
        assert refused == "refused" and "model.layers.0.mlp.down_proj" in message and "forward" in message
        refused, message = out["weight hook"]
        assert refused == "refused" and "model.layers.0.mlp.up_proj.weight" in message, message
        _exact_or_refused(out["falcon eager"], "falcon eager")
        assert "sharded and proven with 'sdpa'" in out["switched"], out["switched"]
        refused, message = out["rms hook"]  # the cut hands the hook one rank's part: refused, naming it
        assert refused == "refused" and "model.layers.1.mlp.down_proj: a forward pre hook" in message, message
        assert out["plain clean"][1] and out["plain clean"][2] < 1e-4, out["plain clean"]


def test_the_study_sees_what_the_instance_adds():
    model = _llama()
    clean = study_instance(model)
    assert clean.extras == {}
    model.model.layers[1].mlp = NormedMLP(model.config)
    handle = model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, a, o: o * 0.5)
    changed = study_instance(model)
    assert set(changed.extras) == {"model.layers.1.mlp", "model.layers.0.self_attn.o_proj"}
    assert changed.key != clean.key
    tiny = tiny_copy(model, 2)  # two blocks: one plain, one with the swapped MLP
    kinds = sorted(type(layer.mlp).__name__ for layer in tiny.model.layers)
    assert kinds == ["LlamaMLP", "NormedMLP"], kinds
    assert any(layer.self_attn.o_proj._forward_hooks for layer in tiny.model.layers)
    handle.remove()
    # the scale a hook captures is part of the key: the same code with another value is another instance
    hooks = [model.model.layers[0].register_forward_hook(lambda m, a, o, s=s: o) for s in (1.0, 2.0)]
    first = study_instance(model).key
    hooks[1].remove()
    model.model.layers[0].register_forward_hook(lambda m, a, o, s=3.0: o)
    assert study_instance(model).key != first
    # the attention implementation and a class patched in place
    eager = _llama()
    eager.set_attn_implementation("eager")
    assert study_instance(eager).key != study_instance(_llama()).key
    assert tiny_copy(eager, 2).config._attn_implementation == "eager"


def test_an_addition_that_cannot_be_built_small_is_named():
    model = _llama(layers=2)
    model.model.layers[0].mlp = SizedMLP(model.config.hidden_size, model.config.intermediate_size)
    with pytest.raises(CannotReproduce, match=r"model\.layers\.0\.mlp is a SizedMLP"):
        tiny_copy(model, 2)
