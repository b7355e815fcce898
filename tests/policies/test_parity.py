"""Every supported class, sharded, against the unsharded model from the same weights.

tp=2: every class under eager attention, one class per family under sdpa too (the same cut around another
attention function); tp=4: one class per family. Each check compares
outputs, loss, every gradient (gathered, vocabulary padding trimmed) and the weights after one
SGD step. Everything at one world size runs in one spawn.
"""

import torch
import torch.distributed as dist

from shardformer import ShardConfig, shard_model
from shardformer.tensor_parallel.layers import gather_from_parallel
from shardformer.tensor_parallel.slicer import gather_tensor, shard_spec
from tests.helpers import GRAD_ATOL, GRAD_RTOL, assert_close, assert_grads_match, check_table
from tests.policies import zoo


def _output_tensors(out):
    if torch.is_tensor(out):
        return {"output": out}
    return {k: v for k, v in out.items() if torch.is_tensor(v)}


def _as_full(value, ref):
    """Vocab-parallel logits come back gathered and trimmed; replicated outputs as they are."""
    if value.shape != ref.shape and value.shape[:-1] == ref.shape[:-1]:
        return gather_from_parallel(value, None, full_size=ref.shape[-1])
    return value


def _drive(model, inputs, weights):
    out = model(**inputs)
    tensors = _output_tensors(out)
    loss = tensors.get("loss")
    if loss is None:  # no labels: a fixed random projection of every output gives every parameter a gradient
        loss = sum((weights[k] * _as_full(v, weights[k])).sum() for k, v in tensors.items())
    return tensors, loss


def parity(ref, model, inputs, what):
    ref.train()
    model.train()
    g = torch.Generator().manual_seed(5)
    ref_out = _output_tensors(ref(**inputs))
    weights = {k: torch.randn(v.shape, generator=g) for k, v in ref_out.items()}

    ref_tensors, ref_loss = _drive(ref, inputs, weights)
    tensors, loss = _drive(model, inputs, weights)
    assert tensors.keys() == ref_tensors.keys(), (tensors.keys(), ref_tensors.keys())
    for key, value in tensors.items():
        assert_close(_as_full(value, ref_tensors[key]), ref_tensors[key], what=f"{what}: {key}")
    assert_close(loss, ref_loss, what=f"{what}: loss")

    ref_loss.backward()
    loss.backward()
    assert_grads_match(model, ref)

    # SGD, not Adam: Adam maps the rounding noise of gradients that are zero in theory (the key
    # bias: softmax ignores a constant per query) to full-size steps of either sign.
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9).step()
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        value = p.detach() if spec is None else gather_tensor(p.detach(), spec, None)
        assert_close(value, full[name].detach(), GRAD_ATOL, GRAD_RTOL, f"{what}: {name} after a step")
    return ref, model


def _hf_check(name, impl):
    ref, model = zoo.load_twice(name, impl)
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    parity(ref, model, zoo.inputs_for(name), f"{name}/{impl}")


def check_timm_vision_transformer():
    ref, model = zoo.timm_pair()
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    parity(ref, model, {"x": pixels}, "timm VisionTransformer")


def check_gpt2_generate_matches_greedy():
    for impl in ("eager", "sdpa"):
        ref, model = zoo.load_twice("GPT2LMHeadModel", impl)
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
        prompt = zoo.inputs_for("GPT2LMHeadModel")["input_ids"][:, :4]
        kwargs = {"max_new_tokens": 8, "do_sample": False, "use_cache": True, "pad_token_id": 0}
        expected = ref.generate(prompt, **kwargs)
        got = model.generate(prompt, **kwargs)
        assert torch.equal(got, expected), (got, expected)
        assert model.lm_head.gather_output is False  # generate gathers only while it runs


def check_sharding_keeps_train_and_eval_mode():
    for mode in (True, False):
        _, model = zoo.load_twice("GPT2LMHeadModel")
        model.train(mode)
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
        assert all(m.training == mode for m in model.modules()), f"a replaced module lost training={mode}"


def check_classification_predictions_match():
    ref, model = zoo.load_twice("BertForSequenceClassification", "sdpa")
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size())).eval()
    inputs = zoo.inputs_for("BertForSequenceClassification")
    inputs.pop("labels")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits.argmax(-1), ref.eval()(**inputs).logits.argmax(-1))


def check_gathered_logits_have_true_vocab_and_same_loss():
    ref, model = zoo.load_twice("GPT2LMHeadModel", "sdpa")
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size(), gather_output=True))
    inputs = zoo.inputs_for("GPT2LMHeadModel")
    out, ref_out = model(**inputs), ref(**inputs)
    assert out.logits.shape[-1] == zoo.VOCAB
    assert_close(out.logits, ref_out.logits, what="gathered logits")
    assert_close(out.loss, ref_out.loss, what="loss on gathered logits")


def check_tied_weights_stay_one_parameter():
    for name, source, target in (
        ("GPT2LMHeadModel", "transformer.wte.weight", "lm_head.weight"),
        ("BertForMaskedLM", "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
        ("BertForMaskedLM", "cls.predictions.decoder.bias", "cls.predictions.bias"),
    ):
        _, model = zoo.load_twice(name)
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
        assert model.get_parameter(source) is model.get_parameter(target), (name, source, target)


def check_return_dict_false_puts_loss_first():
    ref, model = zoo.load_twice("BertForMaskedLM")
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    inputs = zoo.inputs_for("BertForMaskedLM")
    out, ref_out = model(**inputs, return_dict=False), ref(**inputs, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(ref_out)
    assert_close(out[0], ref_out[0], what="loss")


def check_sizes_that_do_not_fit_the_world_fail_clearly():
    _, model = zoo.load_twice("GPT2Model")
    try:
        shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size() * 2))
    except ValueError as e:
        assert f"world size {dist.get_world_size()}" in str(e), e
    else:
        raise AssertionError("expected a ValueError")


_ATTENTION_DROPOUT = {
    "GPT2LMHeadModel": ("attn_pdrop", lambda m: m.transformer.h[0].attn),
    "BertForMaskedLM": ("attention_probs_dropout_prob", lambda m: m.bert.encoder.layer[0].attention.self),
    "ViTModel": ("attention_probs_dropout_prob", lambda m: m.layers[0].attention),
}


def _attention_masks(name, impl, seed, p=0.5):
    """The attention-dropout masks layer 0 drew on this rank (eager: from its returned weights; sdpa:
    None), the output, and whether the caller's global RNG stream moved."""
    attr, attention = _ATTENTION_DROPOUT[name]
    ref, model = zoo.load_twice(
        name, impl, config=type(zoo.config_for(name))(**{**zoo.config_for(name).to_dict(), attr: p})
    )
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size(), seed=seed)).train()
    seen = {}
    attention(model).register_forward_hook(lambda _m, _a, out: seen.update(weights=out[1]))
    inputs = {k: v for k, v in zoo.inputs_for(name).items() if k in ("input_ids", "pixel_values")}
    before = torch.get_rng_state()
    out = model(**inputs)[0].detach()
    moved = not torch.equal(torch.get_rng_state(), before)
    weights = seen["weights"]
    return (None if weights is None else weights.detach() == 0), out, moved, (ref, model, inputs)


def check_attention_probability_dropout_is_per_rank_and_seeded():
    """transformers' attention reads only the dropout's probability: the masks still differ per tp
    rank (different heads, different positions), come from ShardConfig.seed, and leave the caller's
    RNG alone; in eval the model stays exact."""
    for name in _ATTENTION_DROPOUT:
        for impl in ("eager", "sdpa"):
            masks, out, moved, (ref, model, inputs) = _attention_masks(name, impl, seed=11)
            assert not moved, f"{name}/{impl}: the caller's global RNG stream moved"
            again, out_again, _, _ = _attention_masks(name, impl, seed=11)
            assert torch.equal(out, out_again), f"{name}/{impl}: the same ShardConfig.seed gave other masks"
            other, out_other, _, _ = _attention_masks(name, impl, seed=12)
            assert not torch.equal(out, out_other), f"{name}/{impl}: another seed gave the same masks"
            if masks is not None:
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, masks)
                assert masks.any() and not torch.equal(gathered[0], gathered[1]), f"{name}: ranks dropped alike"
            with torch.no_grad():
                expected = ref.eval()(**inputs)[0]
                got = _as_full(model.eval()(**inputs)[0], expected)
                assert_close(got, expected, what=f"{name}/{impl} in eval")
    # timm's fused attention passes attn_drop.p to sdpa: the same stream around it
    outs = []
    for seed in (11, 11, 12):
        _, model = zoo.timm_pair(attn_drop_rate=0.5)
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size(), seed=seed)).train()
        before = torch.get_rng_state()
        outs.append(model(torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))).detach())
        assert torch.equal(torch.get_rng_state(), before), "timm: the caller's global RNG stream moved"
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2]), "timm: masks not from the seed"


def check_sharded_gpt2_does_not_log_the_loss_type_warning():
    """transformers warns once per process that GPT2LMHeadModel's loss_type=None is unrecognised when
    its loss_function is read; sharding resolves it quietly (make demo printed it once per rank)."""
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    hf_logger = logging.getLogger("transformers")
    logging.Logger.warning_once.cache_clear()  # an earlier check may have logged it in this process
    hf_logger.addHandler(handler)
    try:
        _, model = zoo.load_twice("GPT2LMHeadModel")
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
        model(**zoo.inputs_for("GPT2LMHeadModel")).loss.backward()
    finally:
        hf_logger.removeHandler(handler)
    assert not [m for m in seen if "loss_type" in m], seen


def _hf_checks(names, impls):
    checks = []
    for n in names:
        for i in impls:
            name = f"check_{n}_{i}"
            if name not in globals():  # module-level, so spawned ranks can unpickle it by name
                fn = lambda n=n, i=i: _hf_check(n, i)  # noqa: E731
                fn.__name__ = fn.__qualname__ = name
                globals()[name] = fn
            checks.append(globals()[name])
    return checks


# every head class in eager attention; sdpa (the same cut, another attention function) on one class per family
HEADLINE = ["GPT2LMHeadModel", "BertForMaskedLM", "ViTForImageClassification"]
TP2 = [
    *_hf_checks(zoo.GPT2 + zoo.BERT + zoo.VIT, ("eager",)),
    *_hf_checks(HEADLINE, ("sdpa",)),
    check_timm_vision_transformer,
    check_gpt2_generate_matches_greedy,
    check_classification_predictions_match,
    check_sharding_keeps_train_and_eval_mode,
    check_gathered_logits_have_true_vocab_and_same_loss,
    check_tied_weights_stay_one_parameter,
    check_return_dict_false_puts_loss_first,
    check_sizes_that_do_not_fit_the_world_fail_clearly,
    check_attention_probability_dropout_is_per_rank_and_seeded,
    check_sharded_gpt2_does_not_log_the_loss_type_warning,
]
TP4 = [
    *_hf_checks(HEADLINE, ("eager",)),
    check_timm_vision_transformer,
    check_gpt2_generate_matches_greedy,
]

test_tp2 = check_table(TP2, 2)
test_tp4 = check_table(TP4, 4)
