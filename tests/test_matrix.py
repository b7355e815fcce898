"""The model x technique matrix in docs/models.md is generated from the committed sweep results, and
says only what a sweep found."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sweeps import matrix  # noqa: E402


def test_the_committed_matrix_is_the_generated_one():
    with open(matrix.DOCS) as f:
        text = f.read()
    expected = matrix.render(matrix.load_sweeps(os.path.join(ROOT, "sweeps")))
    assert text[text.index(matrix.BEGIN) : text.index(matrix.END) + len(matrix.END)] == expected, (
        "docs/models.md's matrix was edited by hand or the sweep JSON changed: run sweeps/matrix.py"
    )


def test_cells_come_from_sweep_rows_and_unswept_columns_say_so(tmp_path):
    rows = [
        {"task": "causal-lm", "model_type": "llama", "class": "LlamaForCausalLM", "result": "passed", "generate_equal": True},
        {"task": "masked-lm", "model_type": "bert", "class": "BertForMaskedLM", "result": "passed"},
        {"task": "causal-lm", "model_type": "doge", "class": "DogeForCausalLM", "result": "refused"},
    ]  # fmt: skip
    verify = {"sweep": "verify", "date": "2026-01-01", "transformers": "9.9", "tp": 2, "rows": rows, "file": "v.json"}
    sp_rows = [{"task": "causal-lm", "model_type": "llama", "class": "LlamaForCausalLM", "result": "refused"}]
    sp = {"sweep": "plan", "date": "2026-01-02", "transformers": "9.9", "sequence_parallel": True, "rows": sp_rows}
    pp_rows = [{"task": "masked-lm", "model_type": "bert", "class": "BertForMaskedLM", "result": "passed"}]
    pp = {"sweep": "pipeline", "date": "2026-01-03", "transformers": "9.9", "pp": 2, "rows": pp_rows, "file": "p.json"}
    engine_rows = [
        {"task": "causal-lm", "model_type": "llama", "class": "LlamaForCausalLM",
         "techniques": {"ZeRO-3": {"result": "passed"}, "ep": {"result": "n/a"}}},
        {"task": "causal-lm", "model_type": "doge", "class": "DogeForCausalLM", "techniques": {"ZeRO-3": {"result": "failed"}}},
    ]  # fmt: skip
    engine = {
        "sweep": "engine", "date": "2026-01-04", "transformers": "9.9", "techniques": ["ZeRO-3", "ep"],
        "layouts": {"ZeRO-3": "zero_stage=3, dp=2", "ep": "ep=2, dp=2"}, "rows": engine_rows, "file": "e.json",
    }  # fmt: skip
    notes, table = matrix.build([verify, {**sp, "file": "sp.json"}, pp, engine])
    assert notes[0].startswith("[1] tp, generate: verify sweep") and "2026-01-01, transformers 9.9" in notes[0]
    assert notes[1].startswith("[2] sp: plan sweep") and "with sequence parallelism" in notes[1]
    by_class = {row[2]: dict(zip(("family", "head", "class", *matrix.COLUMNS), row)) for row in table}
    llama, bert, doge = by_class["LlamaForCausalLM"], by_class["BertForMaskedLM"], by_class["DogeForCausalLM"]
    assert (llama["tp"], llama["generate"], llama["sp"]) == ("yes (tested) [1]", "yes (tested) [1]", "refused [2]")
    assert (bert["generate"], bert["sp"]) == ("n/a (no generate) [1]", "not swept")
    assert notes[2].startswith("[3] pp: ParallelEngine sweep") and "pp=2 on 2 gloo ranks" in notes[2]
    assert (bert["pp"], llama["pp"], doge["pp"]) == ("yes (tested) [3]", "not swept", "not swept")
    assert (doge["tp"], doge["generate"]) == ("refused [1]", "refused [1]")
    assert notes[3].startswith("[4] ZeRO-3, ep: engine sweep") and "ZeRO-3: zero_stage=3, dp=2" in notes[3]
    assert (llama["ZeRO-3"], llama["ep"], doge["ZeRO-3"]) == ("yes (tested) [4]", "n/a [4]", "failed [4]")
    assert (doge["ep"], bert["ZeRO-3"]) == ("not swept", "not swept")  # a technique the class's row lacks
    for column in ("cp", "ZeRO-1", "ZeRO-2", "checkpointing", "Trainer", "LoRA"):
        assert {row[column] for row in by_class.values()} == {"not swept"}
    # the committed sweeps: as many yes cells in the tp column as the newest verify sweep has passed rows
    sweeps = matrix.load_sweeps(os.path.join(ROOT, "sweeps"))
    newest = [s for s in sweeps if matrix.columns_of(s) == ("tp", "generate")][-1]
    _, table = matrix.build(sweeps)
    passed = sum(r["result"] == "passed" for r in newest["rows"])
    assert len(table) == len(newest["rows"]) and sum(row[3].startswith("yes (tested)") for row in table) == passed


def test_the_readme_summary_is_the_generated_one():
    with open(matrix.README) as f:
        text = f.read()
    expected = matrix.render_summary(matrix.load_sweeps(os.path.join(ROOT, "sweeps")))
    committed = text[text.index(matrix.SUMMARY_BEGIN) : text.index(matrix.SUMMARY_END) + len(matrix.SUMMARY_END)]
    assert committed == expected, "README's summary was edited by hand or the sweep JSON changed: run sweeps/matrix.py"
    assert "| LlamaForCausalLM | yes |" in committed  # tp, from the verify sweep


def test_the_summary_counts_the_classes_each_column_swept():
    rows = [
        {"task": "causal-lm", "model_type": "llama", "class": "LlamaForCausalLM", "result": "passed"},
        {"task": "base-model", "model_type": "bert", "class": "BertModel", "result": "not tested"},
        {"task": "masked-lm", "model_type": "bert", "class": "BertForMaskedLM", "result": "passed"},
    ]  # fmt: skip
    verify = {"sweep": "verify", "date": "2026-01-01", "transformers": "9.9", "tp": 2, "rows": rows, "file": "v.json"}
    engine_rows = [
        {"task": "causal-lm", "model_type": "llama", "class": "LlamaForCausalLM",
         "techniques": {"Trainer": {"result": "passed"}, "LoRA": {"result": "failed"}}},
        {"task": "base-model", "model_type": "bert", "class": "BertModel",
         "techniques": {"Trainer": {"result": "n/a"}, "LoRA": {"result": "n/a"}}},
    ]  # fmt: skip
    engine = {
        "sweep": "engine", "date": "2026-01-04", "transformers": "9.9", "techniques": ["Trainer", "LoRA"],
        "layouts": {"Trainer": "ShardedTrainer", "LoRA": "PEFT LoRA"}, "rows": engine_rows, "file": "e.json",
        "sample": "the first 1 classes of each task",
    }  # fmt: skip
    notes, _ = matrix.build([verify, engine])
    assert "2 base-model/causal-lm classes: the first 1 classes of each task)" in notes[1]
    summary = matrix.render_summary([verify, engine]).splitlines()
    head = summary[2].strip("| ").split(" | ")
    swept = dict(zip(head, summary[4].strip("| ").split(" | ")))
    tested = dict(zip(head, summary[5].strip("| ").split(" | ")))
    assert swept["class"] == "**classes swept** (of all 3)" and (swept["tp"], swept["Trainer"], swept["cp"]) == (
        "3", "2", "0"
    )  # fmt: skip
    assert (tested["tp"], tested["Trainer"], tested["LoRA"]) == ("2 / 2", "1 / 1", "0 / 1")  # n/a and – not tested
