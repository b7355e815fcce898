"""HuggingFace / timm export of tp-sharded models, checked by loading with plain from_pretrained.

Each model is sharded at tp=2 (the vocabulary 99 does not divide: it is padded), trained two SGD
steps, exported, loaded by the original class on rank 0, and its logits compared with the sharded
model's gathered logits. Everything runs in one spawn of 2 ranks.
"""

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as tf
from safetensors import safe_open
from safetensors.torch import load_file

from shardformer import ShardConfig, shard_model
from shardformer.checkpoint import CheckpointError, load_sharded, save_pretrained
from tests.checkpoint.common import full_logits, remove_dir, scheduled_steps, sgd_steps, shared_dir
from tests.helpers import assert_close, check_table
from tests.policies import zoo


def _hf_loss(model, inputs):
    return model(**inputs).loss


def _export_and_compare(name, max_shard_size="2GB", expect_index=False, by_method=False):
    _, model = zoo.load_twice(name)
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    inputs = zoo.inputs_for(name)
    sgd_steps(model, inputs, _hf_loss)
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    vocab = model.config.vocab_size if not name.startswith("ViT") else logits.shape[-1]
    logits = full_logits(logits, vocab, None)
    path = shared_dir()
    if by_method:  # what HF users type: the sharded model's own save_pretrained
        model.save_pretrained(path, max_shard_size=max_shard_size, is_main_process=dist.get_rank() == 0)
    else:
        save_pretrained(model, path, max_shard_size=max_shard_size)
    if dist.get_rank() == 0:
        files = os.listdir(path)
        assert ("model.safetensors.index.json" in files) == expect_index, files
        with open(os.path.join(path, "config.json")) as f:
            assert json.load(f)["architectures"] == [name]
        plain = getattr(tf, name).from_pretrained(path, attn_implementation="eager").eval()
        assert type(plain) is getattr(tf, name)
        with torch.no_grad():
            ref = plain(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        assert_close(ref, logits, what=f"{name} exported logits")
        names = set()
        for file in files:
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(path, file), "pt") as f:
                    names |= set(f.keys())
        return path, names
    remove_dir(path)
    return None, None


def check_gpt2_lm_head_export():
    path, names = _export_and_compare("GPT2LMHeadModel")
    if dist.get_rank() == 0:
        assert "lm_head.weight" not in names and "transformer.wte.weight" in names, sorted(names)
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            assert f.get_slice("transformer.wte.weight").get_shape() == [zoo.VOCAB, 32]
            assert f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape() == [32, 96]
    remove_dir(path) if dist.get_rank() == 0 else None


def check_model_save_pretrained_writes_the_whole_model():
    path, _ = _export_and_compare("BertForMaskedLM", by_method=True)
    remove_dir(path) if dist.get_rank() == 0 else None
    _, model = zoo.load_twice("GPT2LMHeadModel")
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    for call, needle in (
        (lambda: model.transformer.save_pretrained("unused"), "part of a sharded model"),
        (lambda: model.save_pretrained("unused", state_dict=model.state_dict()), "state_dict"),
        (lambda: model.save_pretrained("unused", push_to_hub=True), "push_to_hub"),
    ):
        try:
            call()
        except ValueError as e:
            assert needle in str(e), e
        else:
            raise AssertionError(f"not refused: {needle}")
    assert not os.path.exists("unused")


def check_gpt2_sharded_files_with_index():
    path, _ = _export_and_compare("GPT2LMHeadModel", max_shard_size="20KB", expect_index=True)
    if dist.get_rank() == 0:
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            assert len(set(json.load(f)["weight_map"].values())) > 1
    remove_dir(path) if dist.get_rank() == 0 else None


def check_bert_masked_lm_export():
    path, names = _export_and_compare("BertForMaskedLM")
    if dist.get_rank() == 0:
        assert "cls.predictions.decoder.weight" not in names, sorted(names)
    remove_dir(path) if dist.get_rank() == 0 else None


def check_vit_export():
    path, _ = _export_and_compare("ViTForImageClassification")
    remove_dir(path) if dist.get_rank() == 0 else None


def check_timm_export():
    import timm

    _, model = zoo.timm_pair()
    model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([0, 2])
    sgd_steps(model, pixels, lambda m, x: F.cross_entropy(m(x), labels))
    model.eval()
    with torch.no_grad():
        out = model(pixels)
    path = shared_dir()
    save_pretrained(model, path)
    if dist.get_rank() == 0:
        plain = timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=32, depth=2,
            num_heads=4, num_classes=zoo.LABELS,
        )  # fmt: skip
        plain.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
        with torch.no_grad():
            assert_close(plain.eval()(pixels), out, what="timm exported output")
    remove_dir(path)


def _shard_on_load_matches(name, max_shard_size):
    tp = ShardConfig(tensor_parallel_size=dist.get_world_size())
    _, model = zoo.load_twice(name)
    path = shared_dir()
    save_pretrained(model, path, max_shard_size=max_shard_size)  # an unsharded model exports too
    cls = getattr(tf, name)
    then_shard = shard_model(cls.from_pretrained(path, attn_implementation="eager"), tp)
    on_load = load_sharded(name, path, ShardConfig(tensor_parallel_size=dist.get_world_size()),
                           attn_implementation="eager")  # fmt: skip
    remove_dir(path)
    expected = dict(then_shard.named_parameters())
    got = dict(on_load.named_parameters())
    assert got.keys() == expected.keys(), got.keys() ^ expected.keys()
    for key, param in got.items():
        assert torch.equal(param, expected[key]), key
        assert getattr(param, "shard_spec", None) == getattr(expected[key], "shard_spec", None), key
    for key, buffer in on_load.named_buffers():
        assert buffer.device.type != "meta", key
    inputs = {k: v for k, v in zoo.inputs_for(name).items() if k != "labels"}
    with torch.no_grad():
        assert_close(on_load.eval()(**inputs).logits, then_shard.eval()(**inputs).logits, what=f"{name} logits")
    return on_load


def check_shard_on_load_gpt2():
    model = _shard_on_load_matches("GPT2LMHeadModel", "20KB")  # several files and an index
    assert model.lm_head.weight is model.transformer.wte.weight


def check_shard_on_load_bert():
    model = _shard_on_load_matches("BertForMaskedLM", "2GB")
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias


def check_shard_on_load_vit():
    _shard_on_load_matches("ViTForImageClassification", "2GB")


def check_shard_on_load_reads_final_logits_bias():
    """mBART's and Pegasus' ``final_logits_bias`` is a buffer the checkpoint holds (not zero here): shard-on-load
    reads it (cut with the vocab-parallel head), and saving the loaded model writes the checkpoint back as it was."""
    from shardformer.core.inputs import make_inputs
    from tests.policies.derived_models import transformers_model

    for name in ("MBartForConditionalGeneration", "PegasusForConditionalGeneration"):
        plain = transformers_model(name).eval()  # the same seeded weights on every rank
        with torch.no_grad():
            plain.final_logits_bias.normal_(generator=torch.Generator().manual_seed(5))
        path, again = shared_dir(), shared_dir()
        if dist.get_rank() == 0:
            plain.save_pretrained(path)
        dist.barrier()
        loaded = load_sharded(name, path, ShardConfig(tensor_parallel_size=dist.get_world_size()))
        inputs = make_inputs(plain, seed=3)
        with torch.no_grad():
            want = plain(**inputs).logits
            got = full_logits(loaded(**inputs).logits, want.shape[-1], None)
        assert_close(got, want, what=f"{name} logits after load_sharded")
        save_pretrained(loaded, again)
        if dist.get_rank() == 0:
            before, after = (
                load_file(os.path.join(path, "model.safetensors")),
                load_file(os.path.join(again, "model.safetensors")),
            )
            assert before.keys() == after.keys(), before.keys() ^ after.keys()
            for key, value in before.items():
                assert torch.equal(after[key], value), f"{name}: {key} written back changed"
        remove_dir(path)
        remove_dir(again)


def check_plain_optimizer_checkpoint():
    """A plain torch optimizer (no ZeRO) and a LambdaLR resume exactly at tp=2."""
    from shardformer.checkpoint import load_checkpoint, save_checkpoint

    def make(seed):
        torch.manual_seed(seed)
        model = shard_model(tf.GPT2LMHeadModel(zoo.gpt2_config()), ShardConfig(tensor_parallel_size=2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    path = shared_dir()
    model, opt, sched = make(0)
    scheduled_steps(model, opt, sched, range(3))
    save_checkpoint(path + "/ckpt", model, opt, sched, step=3)
    reference = scheduled_steps(model, opt, sched, range(3, 6))
    fresh, opt2, sched2 = make(1)
    assert load_checkpoint(path + "/ckpt", fresh, opt2, sched2)["step"] == 3
    assert scheduled_steps(fresh, opt2, sched2, range(3, 6)) == reference
    remove_dir(path)


def check_shard_on_load_refuses_a_config_that_disagrees_with_the_weights():
    """What from_pretrained refuses: tp slicing must not read other tensors' bytes or cut silently."""
    torch.manual_seed(0)
    path = shared_dir()
    if dist.get_rank() == 0:
        tf.GPT2LMHeadModel(zoo.gpt2_config()).save_pretrained(path)
    dist.barrier()
    tp = ShardConfig(tensor_parallel_size=2)
    weights = os.path.join(path, "model.safetensors")
    cases = {"vocab_size": (zoo.VOCAB + 9, "transformer.wte.weight has shape [99, 32]"),
             "n_inner": (64, "transformer.h.0.mlp.c_fc.weight has shape [32, 128]")}  # fmt: skip
    cases["vocab_size "] = (zoo.VOCAB - 9, "transformer.wte.weight has shape [99, 32]")
    for key, (value, expected) in cases.items():
        try:
            load_sharded("GPT2LMHeadModel", path, tp, **{key.strip(): value})
            raise AssertionError(f"{key}={value} disagrees with the weights and loaded")
        except CheckpointError as e:
            assert f"{weights}: {expected}" in str(e) and "the config does not match the weights" in str(e), e
    load_sharded("GPT2LMHeadModel", path, tp)  # the config it was saved with loads
    remove_dir(path)


def check_a_damaged_checkpoint_fails_on_every_rank_and_changes_nothing():
    """A file only one rank needs is missing or damaged: every rank raises the same error, untouched."""
    from shardformer.checkpoint import load_checkpoint, save_checkpoint

    def make(seed):
        torch.manual_seed(seed)
        model = shard_model(tf.GPT2LMHeadModel(zoo.gpt2_config()), ShardConfig(tensor_parallel_size=2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sgd_steps(model, zoo.inputs_for("GPT2LMHeadModel"), _hf_loss, steps=1)
        opt.step()  # AdamW state to save, and to keep
        return model, opt

    path = shared_dir()
    ckpt = os.path.join(path, "ckpt")
    damages = {
        "tensors-rank00001-00001-of-00004.safetensors": lambda file: os.remove(file),  # rank 1's tensors
        "tensors-rank00001-00002-of-00004.safetensors": lambda file: _flip_last_byte(file),  # rank 1's tensors
        "ranks/rank1.safetensors": lambda file: _flip_last_byte(file),  # rank 1's RNG state
    }
    for name, damage in damages.items():
        save_checkpoint(ckpt, *make(0), step=1)
        fresh, fresh_opt = make(1)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        opt_before = repr(fresh_opt.state_dict())
        if dist.get_rank() == 0:
            damage(os.path.join(ckpt, name))
        dist.barrier()
        try:
            load_checkpoint(ckpt, fresh, fresh_opt)
            raise AssertionError(f"a damaged {name} loaded")
        except CheckpointError as e:
            message = str(e)
        messages = [None, None]
        dist.all_gather_object(messages, message)
        assert messages[0] == messages[1], messages
        assert os.path.join(ckpt, name) in message and "nothing was changed" in message, message
        assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()), name
        assert repr(fresh_opt.state_dict()) == opt_before, name
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(ckpt)
    remove_dir(path)


def _flip_last_byte(file):
    with open(file, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


CHECKS = [
    check_gpt2_lm_head_export,
    check_model_save_pretrained_writes_the_whole_model,
    check_gpt2_sharded_files_with_index,
    check_bert_masked_lm_export,
    check_vit_export,
    check_timm_export,
    check_shard_on_load_gpt2,
    check_shard_on_load_bert,
    check_shard_on_load_vit,
    check_shard_on_load_reads_final_logits_bias,
    check_plain_optimizer_checkpoint,
    check_shard_on_load_refuses_a_config_that_disagrees_with_the_weights,
    check_a_damaged_checkpoint_fails_on_every_rank_and_changes_nothing,
]
test_export_tp2 = check_table(CHECKS, 2)
