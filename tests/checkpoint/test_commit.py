"""Training checkpoints in one process: what a save refuses, crashes at every step of the commit, damage.

A crash is a forked child that saves and SIGKILLs itself just before or after the n-th call of a
file-system function (``os.rename``, ``os.replace``, ...), wrapped in the child only: the library
has no hook for it. After each crash the checkpoint must load, as the previous or the new step, with
exactly that step's weights, and the next save must leave nothing else behind.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers as tf

import shardformer.checkpoint.rng_state as rng_state
import shardformer.checkpoint.training as training
from shardformer.checkpoint import CheckpointError, commit, load_checkpoint, save_checkpoint
from tests.checkpoint.common import killed_during, scheduled_steps
from tests.policies import zoo


def _model(seed=0, **settings):
    config = zoo.gpt2_config()
    for key, value in settings.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return tf.GPT2LMHeadModel(config)


def test_typed_json_gives_back_what_went_in():
    from collections import Counter, OrderedDict

    from shardformer.checkpoint import typed_json

    value = {"m": Counter({3: 1, 5: 2}), 1: (2, [3, {4: (5,)}]), "o": OrderedDict(b=1, a=2), "s": {1, 2},
             "$t": "x", "f": 0.1 + 0.2, "big": 2**70, "no": None, "yes": True}  # fmt: skip
    back = typed_json.loads(typed_json.dumps(value, "value"), "file")
    assert back == value and repr(back) == repr(value)
    with pytest.raises(CheckpointError, match=r"value\['t'\] holds Tensor"):
        typed_json.dumps({"t": torch.zeros(1)}, "value")


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(model, weights):
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_refuses_to_replace_what_it_did_not_write(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text("print('my sources')\n")
    monkeypatch.chdir(work)
    model = _model()
    for path in ["", ".", "/", str(work), str(tmp_path), "./"]:
        with pytest.raises(CheckpointError, match="empty|working directory or one of its parents"):
            save_checkpoint(path, model)
    assert os.listdir(work) == ["train.py"]

    out = tmp_path / "out"
    (out / "plots").mkdir(parents=True)
    (out / "metrics.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"{out} is a non-empty folder that is not a shardformer checkpoint"):
        save_checkpoint(str(out), model)
    assert sorted(os.listdir(out)) == ["metrics.json", "plots"]

    ckpt = tmp_path / "ckpt"
    save_checkpoint(str(ckpt), model, step=1)
    (ckpt / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"also holds files it did not write \(notes.txt\)"):
        save_checkpoint(str(ckpt), model, step=2)
    (ckpt / "notes.txt").unlink()
    save_checkpoint(str(ckpt), model, step=2)  # its own checkpoint is replaced
    assert load_checkpoint(str(ckpt), _model(seed=1))["step"] == 2

    legacy = tmp_path / "legacy"  # a checkpoint of the previous format (no manifest): its own names only
    legacy.mkdir()
    (legacy / "meta.json").write_text('{"format": "shardformer-checkpoint/1"}')
    (legacy / "rank0.json").write_text("{}")
    (legacy / "plot.png").write_text("mine")
    with pytest.raises(CheckpointError, match=r"also holds files it did not write \(plot.png\)"):
        save_checkpoint(str(legacy), model)
    (legacy / "plot.png").unlink()
    save_checkpoint(str(legacy), model, step=4)
    assert load_checkpoint(str(legacy), _model(seed=1))["step"] == 4

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a folder"):
        save_checkpoint(str(tmp_path / "a_file"), model)
    (tmp_path / "empty").mkdir()
    save_checkpoint(str(tmp_path / "empty"), model, step=3)
    assert load_checkpoint(str(tmp_path / "empty"), _model(seed=1))["step"] == 3


_TARGETS = [(rng_state, "save_file"), (os, "replace"), (os, "rename"), (os, "remove"), (shutil, "rmtree")]


def _save_killed(where, nth, when, path, model, step) -> bool:
    return killed_during(where, nth, when, lambda: save_checkpoint(path, model, step=step))


def test_a_save_killed_at_any_step_leaves_the_previous_or_the_new_checkpoint(tmp_path):
    torch.set_num_threads(1)  # forked children: no thread pool to inherit
    path = str(tmp_path / "ckpt")
    old, new = _model(seed=0), _model(seed=1)
    weights = {1: _weights(old), 2: _weights(new)}
    save_checkpoint(path, old, step=1)
    seen = {}
    for where in _TARGETS:
        for nth in range(1, 10):
            killed = False
            for when in ("before", "after"):
                if not _save_killed(where, nth, when, path, new, 2):  # it saved step 2: back to step 1
                    save_checkpoint(path, old, step=1)
                    continue
                killed, point = True, f"{where[1]} #{nth} {when}"
                fresh = _model(seed=5)
                step = load_checkpoint(path, fresh)["step"]
                assert _same(fresh, weights[step]), f"killed at {point}: weights are not those of step {step}"
                seen[point] = step
                save_checkpoint(path, old, step=1)  # the next save recovers and cleans up
                assert os.listdir(tmp_path) == ["ckpt"], f"killed at {point}: leftovers {os.listdir(tmp_path)}"
            if not killed:
                break
    # Killed between the two renames, no checkpoint is at `path`: the load renames the new one back.
    assert seen["rename #1 before"] == 1 and seen["rename #1 after"] == 2, seen
    assert seen["save_file #1 after"] == 1 and seen["replace #1 after"] == 1 and seen["rmtree #1 before"] == 2, seen
    assert len(seen) == 12, seen  # every call of the commit was a crash point
    # The next save, too, finds the interrupted swap (no checkpoint at `path`) and cleans up.
    assert _save_killed((os, "rename"), 1, "after", path, new, 2) and not os.path.exists(path)
    save_checkpoint(path, old, step=3)
    assert os.listdir(tmp_path) == ["ckpt"] and load_checkpoint(path, _model(seed=5))["step"] == 3
    shutil.rmtree(path)
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {path}"):
        load_checkpoint(path, _model())


def test_a_flipped_byte_is_detected_and_nothing_changes(tmp_path):
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, _model(seed=0))
    file = os.path.join(path, _tensor_file(path))
    _damage(path, _tensor_file(path), lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:])  # a data byte
    _refused_and_unchanged(path, f"{file}: its content does not match its sha256")


def _tensor_file(path):
    """The first safetensors file DCP wrote (tensors under their HF names)."""
    return sorted(n for n in os.listdir(path) if n.startswith("tensors-rank") and n.endswith(".safetensors"))[0]


def _refused_and_unchanged(path, pattern):
    """Loading ``path`` into a fresh model raises ``pattern`` and leaves the model as it was; the model."""
    fresh = _model(seed=1)
    before = _weights(fresh)
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(path, fresh)
    assert _same(fresh, before)
    return fresh


def test_a_flipped_bit_in_the_manifest_is_detected_and_nothing_changes(tmp_path):
    """One bit turns "step": 3 into 7; the manifest's own checksum names the file."""
    path = str(tmp_path / "ckpt")
    model = _model(seed=0)
    save_checkpoint(path, model, step=3)
    meta_file = _damage(path, "meta.json", lambda b: b.replace(b'"step": 3', b'"step": 7'))
    with open(meta_file, "rb") as f:
        assert b'"step": 7' in f.read()
    fresh = _refused_and_unchanged(path, f"{meta_file}: the manifest does not match its own sha256")

    # A manifest of the format before DCP (/3: shardformer's own tensor files) is refused naming its format.
    def older(raw):
        meta = json.loads(raw)
        meta.update(step=3, format="shardformer-checkpoint/3")
        meta[commit.CHECKSUM] = commit.manifest_digest(meta)
        return json.dumps(meta).encode()

    _damage(path, "meta.json", older)
    _refused_and_unchanged(path, "format 'shardformer-checkpoint/3', this shardformer reads 'shardformer-checkpoint/4'")
    save_checkpoint(path, model, step=4)  # its own older checkpoint is replaced
    assert load_checkpoint(path, fresh)["step"] == 4 and _same(fresh, _weights(model))


def test_the_config_must_match_not_only_the_shapes(tmp_path):
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, _model(n_head=4))
    fresh = _model(seed=1, n_head=2)  # the same tensor shapes, a different model
    before = _weights(fresh)
    with pytest.raises(CheckpointError, match="config n_head: 4 in the checkpoint, 2 here"):
        load_checkpoint(path, fresh)
    assert _same(fresh, before)
    load_checkpoint(path, _model(seed=1, n_head=4, resid_pdrop=0.3))  # dropout only changes how it runs


_SCHEDULERS = {
    "MultiStepLR": lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4, 5], gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=0.01),
}
_EXTRA = {"epoch": 1, "seen": {3: (1, 2), (4, "a"): None}, "nested": [{"b": (2.5,)}, {7, 8}], "$t": "mine"}


def _trainer(kind, seed):
    model = _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, _SCHEDULERS[kind](opt)


@pytest.mark.parametrize("kind", list(_SCHEDULERS))
def test_scheduler_and_extra_resume_exactly(tmp_path, kind):
    model, opt, sched = _trainer(kind, 0)
    scheduled_steps(model, opt, sched, range(3))
    save_checkpoint(str(tmp_path / "ckpt"), model, opt, sched, step=3, extra=_EXTRA)
    uninterrupted = scheduled_steps(model, opt, sched, range(3, 7))
    fresh, opt2, sched2 = _trainer(kind, 1)
    info = load_checkpoint(str(tmp_path / "ckpt"), fresh, opt2, sched2)
    assert info["extra"] == _EXTRA and isinstance(info["extra"]["nested"][0]["b"], tuple), info["extra"]
    assert scheduled_steps(fresh, opt2, sched2, range(3, 7)) == uninterrupted


def test_the_optimizer_kind_must_match(tmp_path):
    """An AdamW checkpoint into SGD would load without error and drop its moments: refused."""
    path = str(tmp_path / "ckpt")
    model = _model()
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduled_steps(model, adamw, torch.optim.lr_scheduler.StepLR(adamw, 1), range(1))
    save_checkpoint(path, model, adamw, step=1)
    fresh = _model(seed=1)
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    before = _weights(fresh)
    pattern = f"{os.path.join(path, 'meta.json')} holds AdamW optimizer state, and this optimizer is SGD; resume with torch.optim.AdamW"
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(path, fresh, sgd)
    assert _same(fresh, before) and not sgd.state
    again = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    load_checkpoint(path, fresh, again)
    assert _same(fresh, _weights(model)) and set(next(iter(again.state.values()))) == {"step", "exp_avg", "exp_avg_sq"}


def test_extra_that_would_not_come_back_is_refused_before_writing(tmp_path):
    with pytest.raises(CheckpointError, match=r"holds Tensor"):
        save_checkpoint(str(tmp_path / "ckpt"), _model(), extra={"loss": torch.tensor(1.0)})
    assert os.listdir(tmp_path) == []


def _damage(path, name, change):
    file = os.path.join(path, name)
    with open(file, "rb") as f:
        data = change(f.read())
    with open(file, "wb") as f:
        f.write(data)
    return file


def _rewrite_manifest(path, change):
    """A broken writer: the manifest changed, and checksummed again."""

    def rewrite(raw):
        meta = json.loads(raw)
        change(meta)
        meta[commit.CHECKSUM] = commit.manifest_digest(meta)
        return json.dumps(meta).encode()

    _damage(path, "meta.json", rewrite)


def test_every_damaged_file_is_named(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path / "ckpt")
    meta_file = os.path.join(path, "meta.json")

    def expect(pattern):
        fresh = _model(seed=1)
        before = _weights(fresh)
        with pytest.raises(CheckpointError, match=pattern):
            load_checkpoint(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
        assert _same(fresh, before)
        shutil.rmtree(path)  # a damaged checkpoint is not recognisably ours: saving over it is refused
        save_checkpoint(path, model, opt, step=1)

    save_checkpoint(path, model, opt, step=1)
    _damage(path, "meta.json", lambda b: b[:-10])
    expect(f"{meta_file}: not a readable checkpoint JSON file")
    _damage(path, "meta.json", lambda b: b"\xff\xfe" + b)
    expect(f"{meta_file}: not a readable checkpoint JSON file .UnicodeDecodeError")
    _rewrite_manifest(path, lambda m: m.pop("step"))
    expect(f"{meta_file}: the manifest lacks 'step'")
    os.remove(os.path.join(path, "ranks/rank0.safetensors"))
    expect(f"{os.path.join(path, 'ranks/rank0.safetensors')}: missing")
    # Damaged and yet matching the manifest (a broken writer): the reader names the file too.
    file = _damage(path, "ranks/rank0.json", lambda b: b.replace(b'"rng"', b'"rnd"'))
    _rewrite_manifest(path, lambda m: m["files"]["ranks/rank0.json"].update(sha256=training.commit.sha256_of(file)))
    expect(f"{file}: the RNG state is damaged")
    name = _tensor_file(path)
    file = _damage(path, name, lambda b: b"\x10" + b[1:])
    _rewrite_manifest(path, lambda m: m["files"][name].update(sha256=training.commit.sha256_of(file)))
    expect(f"{file}: not a readable safetensors file")
