"""Shared pieces of the checkpoint tests: a shared temporary folder, training steps, full logits."""

import shutil
import tempfile

import torch
import torch.distributed as dist

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
