"""Saves beside other jobs (in one process and forked children): a live save to the same path is
refused, never deleted as a leftover; a link named like a leftover is never followed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import transformers as tf

from shardformer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_pretrained
from shardformer.checkpoint.save_lock import save_lock
from tests.policies import zoo


def _model(seed=0):
    torch.manual_seed(seed)
    return tf.GPT2LMHeadModel(zoo.gpt2_config())


def _same_weights(a, b):
    other = b.state_dict()
    return all(torch.equal(v, other[k]) for k, v in a.state_dict().items())


def _hold_lock(path):
    """A forked child holding ``path``'s save lock with a live temporary folder, as a saving job does."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            with save_lock(path):
                os.makedirs(f"{path}.tmp-0123abcd")
                with open(f"{path}.tmp-0123abcd/rank0.json", "w") as f:
                    f.write("{}")
                os.write(write, b"x")
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"x"
    os.close(read)
    return pid


def test_a_live_save_by_another_job_is_refused_and_its_folder_kept(tmp_path):
    torch.set_num_threads(1)  # forked children: no thread pool to inherit
    path = str(tmp_path / "ckpt")
    model = _model()
    save_checkpoint(path, model, step=1)
    pid = _hold_lock(path)
    try:
        with pytest.raises(
            CheckpointError, match=rf"{path} is being saved by another job \(pid {pid} on .*lock {path}.lock"
        ):
            save_checkpoint(path, model, step=2)
        with pytest.raises(RuntimeError, match=rf"{path} is being saved by another job \(pid {pid} on "):
            save_pretrained(model, path)
        assert os.listdir(f"{path}.tmp-0123abcd") == ["rank0.json"], "the live save's folder was touched"
        assert load_checkpoint(path, _model(seed=1))["step"] == 1
    finally:
        os.kill(pid, signal.SIGKILL)  # a crashed job: the kernel drops its lock
        os.waitpid(pid, 0)
    save_checkpoint(path, model, step=3)  # and the next save removes its leftovers
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert load_checkpoint(path, _model(seed=1))["step"] == 3


def _saves(path, seed, count):
    """Child: ``count`` saves; exit 0 when every one either succeeded or was refused for the lock."""
    try:
        model = _model(seed)
        for step in range(count):
            try:
                save_checkpoint(path, model, step=seed * 100 + step)
            except CheckpointError as e:
                if "is being saved by another job" not in str(e):
                    raise
        os._exit(0)
    except BaseException:  # noqa: BLE001 - any other failure is what this test looks for
        import traceback

        traceback.print_exc()
        os._exit(1)


def test_two_jobs_saving_to_one_path_never_break_each_other(tmp_path):
    torch.set_num_threads(1)
    path = str(tmp_path / "ckpt")
    pids = []
    for seed in (1, 2):
        pid = os.fork()
        if pid == 0:
            _saves(path, seed, 8)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes == [0, 0], f"a save failed other than by the lock (exit codes {codes}; its traceback is above)"
    fresh = _model(seed=5)
    step = load_checkpoint(path, fresh)["step"]
    assert _same_weights(fresh, _model(seed=step // 100)), f"step {step} holds another job's weights"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_link_named_like_a_leftover_is_never_followed(tmp_path):
    precious = str(tmp_path / "precious")
    save_checkpoint(precious, _model(seed=1), step=9)
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, _model(), step=1)
    links = [f"{path}.old-deadbeef", f"{path}.tmp-cafef00d", f"{path}.old-0badcafe"]
    for link in links:
        os.symlink(precious, link)
    save_checkpoint(path, _model(), step=2)
    save_pretrained(_model(), str(tmp_path / "export"))
    os.symlink(precious, str(tmp_path / "export.old-deadbeef"))
    save_pretrained(_model(), str(tmp_path / "export"))
    assert all(os.path.islink(link) for link in links), "a link was removed"
    assert load_checkpoint(precious, _model())["step"] == 9, "the link's target was changed"
    os.rename(path, str(tmp_path / "moved"))  # no checkpoint at `path`: nothing a link points to is put there
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {path}"):
        load_checkpoint(path, _model())
    assert load_checkpoint(precious, _model())["step"] == 9
