"""PEFT LoRA on sharded models at tp=2, in both orders, against PEFT on the unsharded model.

``shard_model(get_peft_model(model, cfg))`` and ``get_peft_model(shard_model(model), cfg)``, on a tiny
GPT-2 (Conv1D, fused Q|K|V, padded vocabulary: the built-in policy) and a tiny Llama (one key/value
head, replicated over both ranks: the route of transformers' tp plan): the same adapter at init, the
same loss at every AdamW step and the same adapter after them. The adapter ``save_pretrained`` writes
loads in plain PEFT on the unsharded model and in ``PeftModel.from_pretrained`` on a sharded one;
``merge_and_unload`` exports the merged model. What stays refused is refused before the first step.
One spawn of 2 ranks for all of it.
"""

import os
import shutil
import warnings

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from shardformer import ModelSharder, ShardConfig, get_autopolicy, shard_model
from shardformer.core.tiny import tiny_config
from shardformer.tensor_parallel.layers import Linear1D_Col, Linear1D_Row
from shardformer.tensor_parallel.layers.lora import LoraColumnB, LoraRowA
from tests.helpers import assert_close, check_table, full_of
from tests.integrations.common import VOCAB, shared_dir, tiny_gpt2

TP, STEPS, ADAPTER_SEED = 2, 3, 5
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]  # fused column, row (attention and MLP), column
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


MODELS = {"gpt2": (tiny_gpt2, GPT2_TARGETS), "llama": (tiny_llama, LLAMA_TARGETS)}


def lora_config(kind: str, **overrides) -> LoraConfig:
    options = dict(r=4, lora_alpha=8, target_modules=MODELS[kind][1], task_type="CAUSAL_LM", lora_dropout=0.0)
    options.update(fan_in_fan_out=kind == "gpt2", init_lora_weights="gaussian")  # B nonzero: every path counts
    options.update(overrides)
    return LoraConfig(**options)


def with_lora(kind: str, order: str, **overrides):
    """A PEFT model: unsharded (order None), LoRA added then sharded ("peft_first"), or sharded then
    LoRA added ("shard_first"). The adapter is drawn from the same seed each time."""
    build = MODELS[kind][0]
    model = build()
    if order == "shard_first":
        model = shard_model(model, ShardConfig(tensor_parallel_size=TP))
    torch.manual_seed(ADAPTER_SEED)
    peft_model = get_peft_model(model, lora_config(kind, **overrides))
    if order == "peft_first":
        assert shard_model(peft_model, ShardConfig(tensor_parallel_size=TP)) is peft_model
    return peft_model


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + step))


def loss_of(model, step: int = 0) -> torch.Tensor:
    ids = batch(step)
    return model(input_ids=ids, labels=ids).loss


def train(model) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def adapter(model) -> dict[str, torch.Tensor]:
    """Every LoRA weight, full shape (gathered over tp: collective)."""
    return {n: full_of(p.detach(), p).clone() for n, p in model.named_parameters() if "lora_" in n}


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def report(what: str, value: float) -> None:
    if dist.get_rank() == 0:
        print(f"parity {what}: {value:.1e}")


def check_cut(model) -> None:
    """Every LoRA layer's base is a parallel layer and its adapter is cut like it: nothing left whole."""
    wrappers = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert wrappers
    for m in wrappers:
        if isinstance(m.base_layer, Linear1D_Col):
            assert isinstance(m.lora_B["default"], LoraColumnB) and type(m.lora_A["default"]) is torch.nn.Linear
        else:
            assert isinstance(m.base_layer, Linear1D_Row), type(m.base_layer)
            assert isinstance(m.lora_A["default"], LoraRowA) and type(m.lora_B["default"]) is torch.nn.Linear


def _both_orders_train_exactly(kind: str) -> None:
    ref = with_lora(kind, None)
    ref_init = adapter(ref)
    ref_losses, ref_after = train(ref), adapter(ref)
    for order in ("peft_first", "shard_first"):
        model = with_lora(kind, order)
        check_cut(model)
        assert worst(adapter(model), ref_init) == 0.0, f"{order}: the adapter is not PEFT's at init"
        losses = train(model)
        assert_close(torch.tensor(losses), torch.tensor(ref_losses), what=f"{kind} {order} losses")
        after = adapter(model)
        for name, value in ref_after.items():
            assert_close(after[name], value, what=f"{kind} {order} {name} after {STEPS} steps")
        report(f"{kind} {order}: losses", max(abs(a - b) for a, b in zip(losses, ref_losses)))
        report(f"{kind} {order}: adapter after {STEPS} AdamW steps", worst(after, ref_after))


def check_gpt2_lora_trains_exactly_in_both_orders():
    _both_orders_train_exactly("gpt2")


def check_llama_lora_trains_exactly_in_both_orders():
    _both_orders_train_exactly("llama")


def _saved_adapter_and_merge(kind: str, order: str) -> None:
    ref, model = with_lora(kind, None), with_lora(kind, order)
    train(ref), train(model)
    folder = shared_dir()
    model.save_pretrained(os.path.join(folder, "adapter"))  # collective: global rank 0 writes the full adapter
    build = MODELS[kind][0]
    if dist.get_rank() == 0:  # plain PEFT, unsharded base
        plain = PeftModel.from_pretrained(build(), os.path.join(folder, "adapter"))
        ids = batch(7)
        logits = plain(input_ids=ids).logits
        assert_close(logits, ref(input_ids=ids).logits, what=f"{kind}: saved adapter in plain PEFT, logits")
        report(f"{kind} {order}: saved adapter, plain PEFT logits", (logits - ref(input_ids=ids).logits).abs().max())
    loaded = PeftModel.from_pretrained(shard_model(build(), ShardConfig(tensor_parallel_size=TP)), f"{folder}/adapter")
    check_cut(loaded)
    assert_close(loss_of(loaded, 7), loss_of(ref, 7), what=f"{kind}: saved adapter loaded onto a sharded model")
    assert worst(adapter(loaded), adapter(ref)) < 1e-5

    merged = model.merge_and_unload()
    assert not any(hasattr(m, "lora_A") for m in merged.modules())
    assert_close(loss_of(merged, 7), loss_of(ref, 7), what=f"{kind}: merged sharded model's loss")
    merged.save_pretrained(os.path.join(folder, "merged"))  # the library's export: the whole merged model
    if dist.get_rank() == 0:
        exported = type(ref.get_base_model()).from_pretrained(os.path.join(folder, "merged")).state_dict()
        expected = ref.merge_and_unload().state_dict()
        report(f"{kind} {order}: merged export weights", worst(exported, expected))
        for name, value in expected.items():
            assert_close(exported[name], value, what=f"{kind}: merged export {name}")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


def check_llama_saved_adapter_loads_in_plain_peft_and_merges():
    _saved_adapter_and_merge("llama", "shard_first")


def check_gpt2_saved_adapter_loads_in_plain_peft_and_merges():
    _saved_adapter_and_merge("gpt2", "peft_first")


def _refused(call, *fragments) -> None:
    try:
        call()
    except ValueError as e:
        assert all(f in str(e) for f in fragments), str(e)
        return
    raise AssertionError(f"not refused: {fragments}")


def check_what_cannot_be_cut_is_refused_before_the_first_step():
    sharded = lambda: shard_model(tiny_llama(), ShardConfig(tensor_parallel_size=TP))  # noqa: E731
    for order in ("peft_first", "shard_first"):  # dropout on a row-parallel base's input slice
        _refused(lambda o=order: with_lora("llama", o, lora_dropout=0.1), "lora_dropout=0.1", "o_proj", "dropout=0")
        _refused(lambda o=order: with_lora("llama", o, use_dora=True), "use_dora", "plain LoRA")
    _refused(
        lambda: get_peft_model(sharded(), LoraConfig(target_modules=["embed_tokens"])), "embedding", "target_modules"
    )
    wrapped = get_peft_model(tiny_llama(), LoraConfig(target_modules=["embed_tokens"]))
    _refused(lambda: shard_model(wrapped, ShardConfig(tensor_parallel_size=TP)), "embed_tokens", "embedding")
    assert type(wrapped.base_model.model.model.embed_tokens).__name__ == "Embedding"  # refused: left as it was
    _refused(lambda: get_peft_model(sharded(), lora_config("llama", init_lora_weights="pissa")), "pissa")
    sp = ShardConfig(tensor_parallel_size=TP, sequence_parallel=True)
    _refused(lambda: shard_model(with_lora("llama", None), sp), "sequence_parallel=False")
    for extra in ({"modules_to_save": ["lm_head"]}, {"trainable_token_indices": [3]}):  # whole copies of cut layers
        config = LoraConfig(target_modules=["q_proj"], **extra)
        _refused(lambda c=config: get_peft_model(sharded(), c), next(iter(extra)))
        _refused(lambda c=config: shard_model(get_peft_model(tiny_llama(), c), ShardConfig(tensor_parallel_size=TP)),
                 "modules_to_save / trainable_token_indices")  # fmt: skip
    moe = get_peft_model(MixtralForCausalLM(tiny_config(MixtralConfig)), LoraConfig(target_modules="all-linear"))
    _refused(
        lambda: shard_model(moe, ShardConfig(tensor_parallel_size=TP)), "mlp.experts (ParamWrapper)", "target_modules"
    )
    assert type(moe.base_model.model.model.layers[0].mlp.experts).__name__ == "ParamWrapper"  # left as it was
    model = get_peft_model(tiny_gpt2(), lora_config("gpt2"))
    _refused(lambda: ModelSharder(model, get_autopolicy(tiny_gpt2()), ShardConfig(tensor_parallel_size=TP)).shard(),
             "c_attn", "shard_model")  # fmt: skip


def _adapted(model) -> list[str]:
    return sorted(n.split(".lora_A.")[0].removeprefix("base_model.model.") for n, _ in model.named_parameters()
                  if ".lora_A." in n)  # fmt: skip


def check_all_linear_and_a_replicated_module_to_save_in_both_orders():
    """target_modules="all-linear" picks the parallel layers as PEFT picks their originals (the head left
    out); modules_to_save on a layer tp does not cut (the final norm) trains as on the unsharded model."""
    for kind in ("llama", "gpt2"):
        overrides = dict(target_modules="all-linear", modules_to_save=["norm"] if kind == "llama" else ["ln_f"])
        reference = with_lora(kind, None, **overrides)
        expected = _adapted(reference)
        assert len(expected) == (14 if kind == "llama" else 8), expected
        losses = train(reference)
        for order in ("peft_first", "shard_first"):
            model = with_lora(kind, order, **overrides)
            assert _adapted(model) == expected, (order, _adapted(model))
            assert_close(torch.tensor(train(model)), torch.tensor(losses), what=f"{kind} all-linear {order} losses")


def check_lora_on_parallel_layers_is_not_warned_about():
    """PEFT warns "Unsupported layer type ... proceed at your own risk" on a layer type it does not know;
    our parallel layers are sized by their LoRA layer, so neither order warns."""
    for kind in MODELS:
        for order in ("peft_first", "shard_first"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with_lora(kind, order)
            unsupported = [str(w.message) for w in caught if "Unsupported layer type" in str(w.message)]
            assert unsupported == [], (kind, order, unsupported)


test_peft_at_tp2 = check_table(
    [
        check_lora_on_parallel_layers_is_not_warned_about,
        check_gpt2_lora_trains_exactly_in_both_orders,
        check_llama_lora_trains_exactly_in_both_orders,
        check_llama_saved_adapter_loads_in_plain_peft_and_merges,
        check_gpt2_saved_adapter_loads_in_plain_peft_and_merges,
        check_what_cannot_be_cut_is_refused_before_the_first_step,
        check_all_linear_and_a_replicated_module_to_save_in_both_orders,
    ],
    TP,
)
