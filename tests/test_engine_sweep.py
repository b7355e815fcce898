"""The engine sweep's choices that need no ranks: the stratified sample (``--per-task``), the layouts the
tables print for the fine-tuning columns, LoRA's targets, and the heads Trainer cannot train."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sweeps.engine import ENGINE_NAMES, engine_batches, has_labels, layout_text  # noqa: E402
from sweeps.finetune import _lora_targets, train_under_trainer  # noqa: E402
from sweeps.zoo import newest_verify_sweep, per_task  # noqa: E402
from tests.helpers import PEFT_READS_A_DEPRECATED_PROPERTY  # noqa: E402


def test_per_task_takes_the_first_classes_that_passed_at_tp_each_technique_included(tmp_path):
    verify = [
        {"class": "A", "result": "passed"}, {"class": "B", "result": "refused"}, {"class": "C", "result": "passed"},
        {"class": "D", "result": "passed"}, {"class": "E", "result": "passed"},
    ]  # fmt: skip
    path = tmp_path / "conformance-2026-01-01.json"
    path.write_text(json.dumps({"sweep": "verify", "rows": verify}))
    rows = [
        {"task": task, "class": name, "technique": technique}
        for task, names in (("causal-lm", "ABCD"), ("masked-lm", "E"))
        for name in names
        for technique in ("pp", "Trainer")
    ]
    sample = per_task(rows, 2, str(path))
    assert [(r["class"], r["technique"]) for r in sample] == [
        ("A", "pp"), ("A", "Trainer"), ("C", "pp"), ("C", "Trainer"), ("E", "pp"), ("E", "Trainer"),
    ]  # fmt: skip
    also = per_task(rows, 1, str(path), frozenset({"B"}))  # a named class joins the sample, passed or not
    assert [r["class"] for r in also] == ["A", "A", "B", "B", "E", "E"]
    (tmp_path / "conformance-2026-02-01.json").write_text("{}")
    (tmp_path / "conformance-engine-2026-03-01.json").write_text("{}")  # not a verify sweep
    assert newest_verify_sweep(str(tmp_path)).endswith("conformance-2026-02-01.json")


def test_the_fine_tuning_techniques_and_their_layouts():
    assert (ENGINE_NAMES["trainer"], ENGINE_NAMES["lora"]) == ("Trainer", "LoRA")
    assert "tp=2 where the class shards at tp=2, else tp=1 x dp=2" in layout_text("Trainer")
    assert "default targets, else all-linear" in layout_text("LoRA")
    assert layout_text("ZeRO-3") == "zero_stage=3, dp=2"


@PEFT_READS_A_DEPRECATED_PROPERTY
def test_lora_takes_peft_defaults_else_all_linear_and_a_head_without_labels_is_not_applicable():
    from transformers import BertConfig, BertForQuestionAnswering, BertModel, ViTConfig, ViTModel

    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    qa = BertForQuestionAnswering(BertConfig(vocab_size=32, **small))
    batches = engine_batches(qa, {"task": "question-answering"})  # a span in each sequence: the head's loss
    assert all(has_labels(b) and int(b["end_positions"].max()) < b["input_ids"].shape[-1] for b in batches)
    assert qa(**batches[0]).loss is not None
    _, targets = _lora_targets(BertModel(BertConfig(vocab_size=32, **small)))
    assert targets is None  # PEFT has default targets for bert (query, value)
    vit, targets = _lora_targets(ViTModel(ViTConfig(image_size=8, patch_size=4, **small)))
    assert targets == "all-linear" and any("lora_A" in n for n, _ in vit.named_parameters())
    row = {"task": "base-model", "model_type": "bert", "class": "BertModel", "technique": "Trainer"}
    train_under_trainer(row, lora=False)  # returns before any collective: no ranks needed
    assert row["result"] == "n/a" and "no labels" in row["reason"]
