"""Asynchronous training checkpoint saves (``save_checkpoint(..., async_save=True)``).

On 2 gloo ranks (one spawn): an asynchronous save writes exactly the files a synchronous one writes
of the same state, although training changes the model while it runs; a second save (and a load)
waits for the one in flight. In forked ranks of their own: a rank killed in the middle of an
asynchronous save leaves the previous checkpoint intact and loadable, and its partial folder unused.
"""

import json
import os
import signal
import struct
import time

import torch
import torch.distributed as dist
import transformers as tf

import shardformer.checkpoint.dcp_io as dcp_io
from shardformer import ShardConfig, shard_model
from shardformer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from shardformer.checkpoint.async_save import TIMEOUT_ENV
from shardformer.checkpoint.commit import CHECKSUM, read_meta
from tests.checkpoint.common import remove_dir, shared_dir
from tests.checkpoint.test_training import _gpt2, _train, _trainer
from tests.helpers import check_table
from tests.policies import zoo


def _content(file: str):
    """A file's content; a safetensors file's as its parsed header and its data (safetensors writes the
    header's metadata in no fixed order, so equal files may differ in bytes)."""
    with open(file, "rb") as f:
        data = f.read()
    if not file.endswith(".safetensors"):
        return data
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    meta = header.get("__metadata__", {})
    if "DCP_SHARDING_INFO" in meta:
        meta["DCP_SHARDING_INFO"] = json.loads(meta["DCP_SHARDING_INFO"])
    return header, data[8 + size :]


def check_async_save_writes_what_a_sync_save_writes():
    path = shared_dir()
    model = _gpt2(2, dropout=0.1)
    opt, sched = _trainer(model, "adamw")
    _train(model, opt, sched, range(1, 3))
    save_checkpoint(os.path.join(path, "sync"), model, opt, sched, step=2, extra={"epoch": 1})
    handle = save_checkpoint(
        os.path.join(path, "async"), model, opt, sched, step=2, extra={"epoch": 1}, async_save=True
    )
    _train(model, opt, sched, range(3, 5))  # training goes on while it writes: the staged copy is saved
    handle.wait()
    assert handle.done()
    sync, done = read_meta(os.path.join(path, "sync")), read_meta(os.path.join(path, "async"))
    assert sync["files"].keys() == done["files"].keys()
    for name in sync["files"]:
        assert _content(os.path.join(path, "sync", name)) == _content(os.path.join(path, "async", name)), name
    differs = {"saved_at", "files", CHECKSUM}  # the checksum covers saved_at
    assert {k: v for k, v in sync.items() if k not in differs} == {k: v for k, v in done.items() if k not in differs}
    remove_dir(path)


def check_a_second_save_waits_for_the_first():
    path = shared_dir()
    ckpt = os.path.join(path, "ckpt")
    model = _gpt2(2)
    opt, sched = _trainer(model)
    real, calls = dcp_io.save_state, []

    def slow(*args, **kwargs):  # the first save's write takes a second longer
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(1.0)
        return real(*args, **kwargs)

    dcp_io.save_state = slow
    try:
        first = save_checkpoint(ckpt, model, opt, sched, step=1, async_save=True)
        assert not first.done()
        second = save_checkpoint(ckpt, model, opt, sched, step=2, async_save=True)
        assert first.done(), "the second save started while the first was in flight"
        assert load_checkpoint(ckpt, model, opt, sched)["step"] == 2  # the load waits for the second
        assert second.done()
    finally:
        dcp_io.save_state = real
    dist.barrier()
    assert sorted(os.listdir(path)) == ["ckpt"], os.listdir(path)
    remove_dir(path)


CHECKS = [check_async_save_writes_what_a_sync_save_writes, check_a_second_save_waits_for_the_first]
test_async_save_world2 = check_table(CHECKS, 2)


def _model(seed):
    torch.manual_seed(seed)
    return tf.GPT2LMHeadModel(zoo.gpt2_config())


def _rank_of_crashing_job(rank: int, store: str, ckpt: str) -> int:
    """A forked rank: a checkpoint at step 1, then an asynchronous save at step 2 during whose write rank 1
    is killed. Rank 0's exit status: 0 when the save failed with a CheckpointError, as it must."""
    os.environ[TIMEOUT_ENV] = "20"  # the save thread's group gives up on a dead peer
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = shard_model(_model(0), ShardConfig(tensor_parallel_size=2))
    save_checkpoint(ckpt, model, step=1)
    real = dcp_io.save_state

    def killed_after_writing(*args, **kwargs):
        out = real(*args, **kwargs)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    dcp_io.save_state = killed_after_writing
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    handle = save_checkpoint(ckpt, model, step=2, async_save=True)
    try:
        handle.wait()
    except CheckpointError:
        return 0
    return 4


def test_async_save_interrupted_by_a_killed_rank(tmp_path):
    torch.set_num_threads(1)  # forked ranks: no thread pool to inherit
    ckpt, store = str(tmp_path / "ckpt"), str(tmp_path / "store")
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = _rank_of_crashing_job(rank, store, ckpt)
            finally:
                os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + 120
    statuses = {}
    while len(statuses) < 2 and time.monotonic() < deadline:
        for pid in pids:
            if pid not in statuses and (done := os.waitpid(pid, os.WNOHANG))[0]:
                statuses[pid] = done[1]
        time.sleep(0.05)
    for pid in set(pids) - set(statuses):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert len(statuses) == 2, "a rank hung after its peer was killed"
    rank0, rank1 = (statuses[p] for p in pids)
    assert os.WIFSIGNALED(rank1) and os.WTERMSIG(rank1) == signal.SIGKILL, rank1
    assert os.waitstatus_to_exitcode(rank0) == 0, f"rank 0 exit {os.waitstatus_to_exitcode(rank0)}"
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith("ckpt.tmp-")]
    assert leftovers, "the interrupted save left no partial folder: it was not interrupted mid-write"
    fresh = _model(5)
    assert load_checkpoint(ckpt, fresh)["step"] == 1  # the previous checkpoint, not the partial one
    expected = _model(0).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    save_checkpoint(ckpt, fresh, step=3)  # the next save clears the leftover
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt")) == ["ckpt"]
