"""HuggingFace folders in one process: what an export removes, and what shard-on-load refuses to read.

The checks that need real tp slicing (a config disagreeing with the weights) run at tp=2 in
test_export.py's spawn.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import transformers as tf
from safetensors import safe_open

from shardformer import ShardConfig
from shardformer.checkpoint import CheckpointError, load_sharded, save_pretrained
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
