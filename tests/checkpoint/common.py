"""Shared pieces of the checkpoint tests: a shared temporary folder, training steps, full logits, crashes,
two HuggingFace folders compared."""

import json
import os
import shutil
import signal
import tempfile
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shardformer.tensor_parallel.layers import gather_from_parallel
from tests.policies import zoo


def shared_dir(prefix="sf-ckpt-"):
    """A fresh folder every rank can see (made on rank 0, its name broadcast)."""
    box = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def remove_dir(path):
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def full_logits(logits, vocab, group):
    """Vocab-parallel logits gathered to the true vocabulary (replicated outputs returned as they are)."""
    if logits.shape[-1] == vocab:
        return logits
    return gather_from_parallel(logits, group, full_size=vocab)


def sgd_steps(model, inputs, loss_of, steps=2, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, inputs).backward()
        opt.step()
    return model


def scheduled_steps(model, opt, sched, steps):
    """SGD-style steps on seeded random tokens; (loss, learning rates) after each, to compare runs exactly."""
    out = []
    for step in steps:
        ids = torch.randint(3, zoo.VOCAB, (2, zoo.SEQ), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append((loss.item(), sched.get_last_lr()))
    return out


def killed_during(where, nth, when, save) -> bool:
    """``save()`` in a forked child killed before/after the nth call of ``where`` (an ``(owner, name)``
    function wrapped in the child only); True if it was killed, False if it finished first."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            owner, name = where
            real, calls = getattr(owner, name), [0]

            def wrapped(*args, **kwargs):
                calls[0] += 1
                if calls[0] == nth and when == "before":
                    os.kill(os.getpid(), signal.SIGKILL)
                out = real(*args, **kwargs)
                if calls[0] == nth and when == "after":
                    os.kill(os.getpid(), signal.SIGKILL)
                return out

            setattr(owner, name, wrapped)
            save()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - a failed save is not the crash asked for
            os._exit(3)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise TimeoutError(f"the save killed at {where[1]} #{nth} ({when}) did not finish in 60 s")
        time.sleep(0.02)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, f"the save failed (exit {os.WEXITSTATUS(status)}) instead of crashing"
    return False


def same_folder(got: str, expected: str) -> None:
    """Two HuggingFace folders with the same files, tensors and config."""
    assert sorted(os.listdir(got)) == sorted(os.listdir(expected)), (os.listdir(got), os.listdir(expected))
    for name in os.listdir(expected):
        if name.endswith(".safetensors"):
            a, b = load_file(os.path.join(got, name)), load_file(os.path.join(expected, name))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        elif name.endswith(".json"):
            with open(os.path.join(got, name)) as f, open(os.path.join(expected, name)) as g:
                assert json.load(f) == json.load(g), name
