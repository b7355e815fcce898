"""HuggingFace folders in one process: what an export removes, and what shard-on-load refuses to read.

The checks that need real tp slicing (a config disagreeing with the weights) run at tp=2 in
test_export.py's spawn.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
import transformers as tf
from safetensors import safe_open

import shardformer.checkpoint.consolidate as consolidate
from shardformer import ShardConfig
from shardformer.checkpoint import CheckpointError, load_sharded, save_checkpoint, save_pretrained
from shardformer.cli.main import main as cli_main
from tests.checkpoint.common import killed_during, same_folder
from tests.policies import zoo


def _gpt2():
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(zoo.gpt2_config()).eval()


def test_export_removes_only_its_own_earlier_weights(tmp_path):
    foreign = ["model_best.safetensors", "modeling_lora.safetensors", "model.safetensors.bak", "notes.txt"]
    for name in foreign:
        (tmp_path / name).write_bytes(b"mine")
    model = _gpt2()
    save_pretrained(model, str(tmp_path), max_shard_size="20KB")
    shards = sorted(n for n in os.listdir(tmp_path) if n.startswith("model-0"))
    assert len(shards) > 1 and "model.safetensors.index.json" in os.listdir(tmp_path)
    save_pretrained(model, str(tmp_path))  # now one file: the shards and the index of the last export go
    assert sorted(os.listdir(tmp_path)) == sorted(
        [*foreign, "config.json", "generation_config.json", "model.safetensors"]
    )
    assert all((tmp_path / name).read_bytes() == b"mine" for name in foreign)
    ids = torch.arange(3, 3 + zoo.SEQ)[None]
    with torch.no_grad():
        torch.testing.assert_close(tf.GPT2LMHeadModel.from_pretrained(tmp_path)(ids).logits, model(ids).logits)


def test_a_bf16_export_loads_as_bf16_with_dtype_auto(tmp_path):
    """A model loaded in fp32 (its config says float32) and cast to bf16 exports bf16 weights: the
    config must say so, or from_pretrained(dtype="auto") loads them as fp32."""
    _gpt2().save_pretrained(tmp_path / "fp32")
    model = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "fp32").to(torch.bfloat16).eval()
    save_pretrained(model, str(tmp_path / "bf16"))
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    loaded = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "bf16", dtype="auto").eval()
    assert loaded.dtype == torch.bfloat16
    ids = torch.arange(3, 3 + zoo.SEQ)[None]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def _exported_weights(path):
    loaded = tf.GPT2LMHeadModel.from_pretrained(path)
    return {k: v.detach().clone() for k, v in loaded.state_dict().items()}


def test_an_export_killed_at_any_step_leaves_the_earlier_or_the_new_export_whole(tmp_path):
    """No crash leaves a mixed folder (1 tensor file new, the rest old) that from_pretrained would load."""
    torch.set_num_threads(1)  # forked children: no thread pool to inherit
    path = tmp_path / "export"
    old, new = _gpt2(), tf.GPT2LMHeadModel(zoo.gpt2_config()).eval()
    torch.nn.init.normal_(new.transformer.wte.weight)  # seeds aside: the two exports differ in every file
    export = lambda model: save_pretrained(model, str(path), max_shard_size="20KB")  # noqa: E731
    export(old)
    (path / "tokenizer.json").write_text("{}")  # the user's file: kept by every export
    weights = {"old": _exported_weights(path), "new": None}
    export(new)
    weights["new"] = _exported_weights(path)
    assert not all(torch.equal(weights["old"][k], v) for k, v in weights["new"].items())
    seen = {}
    for where in [(consolidate, "write_file"), (os, "link"), (os, "fsync"), (os, "rename"), (shutil, "rmtree")]:
        for nth in range(1, 12):
            if not any(killed_during(where, nth, when, lambda: export(old)) for when in ("before", "after")):
                break
            point = f"{where[1]} #{nth}"
            if path.exists():
                got = _exported_weights(path)
                which = next((w for w, ref in weights.items() if all(torch.equal(got[k], ref[k]) for k in ref)), None)
                assert which is not None, f"killed at {point}: {path} mixes the two exports"
                assert (path / "tokenizer.json").read_text() == "{}", f"killed at {point}: the user's file is gone"
            else:  # between the two renames: the complete new folder waits beside it
                which = "between the renames"
            seen[point] = which
            export(new)  # the next export finishes what a crash interrupted and removes the leftovers
            assert sorted(os.listdir(tmp_path)) == ["export"], f"killed at {point}: {os.listdir(tmp_path)}"
            assert (path / "tokenizer.json").read_text() == "{}", f"after the crash at {point}: the user's file is gone"
    assert "between the renames" in seen.values() and {"old", "new"} <= set(seen.values()), seen


def _set_index(path, weight_map):
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def test_shard_on_load_reads_only_inside_the_folder_and_names_bad_files(tmp_path):
    folder = tmp_path / "model"
    _gpt2().save_pretrained(folder)
    (tmp_path / "outside.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())  # noqa: SIM118 - a safetensors handle, not a dict
    load = lambda: load_sharded("GPT2LMHeadModel", str(folder), ShardConfig(tensor_parallel_size=1))  # noqa: E731
    for escape in ["../outside.safetensors", str(tmp_path / "outside.safetensors")]:
        _set_index(folder, dict.fromkeys(names, escape))
        with pytest.raises(CheckpointError, match="which is not inside"):
            load()
    index = folder / "model.safetensors.index.json"
    index.write_bytes(b"\xff{")
    with pytest.raises(CheckpointError, match=f"{index}: not a readable safetensors index"):
        load()
    index.unlink()

    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    first = next(n for n in header if n != "__metadata__" and header[n]["dtype"] == "F32")
    header[first]["dtype"] = "I32"  # the same byte size: only the dtype check can tell
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    weights.write_bytes(raw[:8] + text + raw[8 + length :])
    with pytest.raises(CheckpointError, match=f"{weights}: {first} is I32, the model holds torch.float32"):
        load()
    weights.write_bytes(raw[:-7])
    with pytest.raises(CheckpointError, match=f"{weights}: not a readable safetensors file"):
        load()


def test_convert_refuses_what_is_no_checkpoint_and_converts_a_timm_one(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert cli_main(["convert", str(tmp_path / "nothing"), "--to", "hf", out]) == 1
    assert "has no meta.json: it is not a (finished) shardformer checkpoint" in capsys.readouterr().err
    assert not os.path.exists(out)
    model, _ = zoo.timm_pair()
    save_checkpoint(str(tmp_path / "ckpt"), model, step=1)
    save_pretrained(model, str(tmp_path / "export"))
    assert cli_main(["convert", str(tmp_path / "ckpt"), "--to", "hf", out]) == 0
    same_folder(out, str(tmp_path / "export"))  # timm's own config.json: its architecture and num_classes
