"""A derived policy checked on a real model: sharded vs unsharded, from the same weights.

Run on every rank of an initialised process group: a tiny model is built from ``config`` on rank
0, saved, loaded twice with ``from_pretrained`` (reference and to-be-sharded), sharded over the
whole group, and compared on logits, loss, every gradient (gathered) and greedy ``generate``.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardformer.api import shard_model
from shardformer.core.compare import compare_params, max_error
from shardformer.core.config import ShardConfig
from shardformer.tensor_parallel.regions import gather_from_parallel


class RefusedError(Exception):
    """The sharder refused the model (before any collective): the reason is the message."""


class NotTestedError(Exception):
    """The tiny model cannot be built or does not run unsharded: nothing of the library was tested."""


@dataclass
class Result:
    """Largest differences against the unsharded model, and what did not match."""

    logits: float = 0.0
    loss: float = 0.0
    grad: float = 0.0
    generate_equal: bool = True
    vocab_parallel_logits: bool = False
    failures: list[str] = field(default_factory=list)


def load_pair(model_class, config, attn_implementation="eager", seed=0):
    """Build ``model_class(config)`` on rank 0, save it, and load it twice on every rank."""
    rank = dist.get_rank()
    box = [tempfile.mkdtemp(prefix="sf-plan-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = box[0]
    try:
        error = [None]
        if rank == 0:
            try:
                torch.manual_seed(seed)
                model_class(config).save_pretrained(path)
            except Exception as e:  # noqa: BLE001 - every rank raises it, none waits for rank 0
                error = [f"{type(e).__name__}: {e}"]
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise NotTestedError(f"a tiny {model_class.__name__} cannot be built from this config: {error[0]}")
        try:
            models = [model_class.from_pretrained(path, attn_implementation=attn_implementation) for _ in range(2)]
        except ValueError as e:  # the same on every rank: e.g. no sdpa support for this architecture
            raise RefusedError(f"{model_class.__name__} does not load with {attn_implementation}: {e}") from e
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return models


def compare(
    model_class, config, attn_implementation="eager", seq=8, batch=2, new_tokens=6, sequence_parallel=False
) -> Result:
    """Shard a tiny ``model_class`` at tp = the group size and compare it with the unsharded copy."""
    ref, model = load_pair(model_class, config, attn_implementation)
    try:
        shard_config = ShardConfig(tensor_parallel_size=dist.get_world_size(), sequence_parallel=sequence_parallel)
        model = shard_model(model, shard_config)
    except (ValueError, NotImplementedError, TypeError) as e:
        raise RefusedError(f"{type(e).__name__}: {e}") from e
    vocab = config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels = ids.masked_fill(torch.rand(batch, seq, generator=g) < 0.2, -100)
    result = Result()

    ref.train()
    model.train()
    try:
        torch.manual_seed(1234)  # models that draw random numbers in training (router jitter) draw the same
        ref_out = ref(input_ids=ids, labels=labels)
    except Exception as e:  # noqa: BLE001 - the same on every rank: nothing of ours ran yet
        raise NotTestedError(f"the tiny unsharded model does not run: {type(e).__name__}: {e}") from e
    torch.manual_seed(1234)
    out = model(input_ids=ids, labels=labels)
    result.vocab_parallel_logits = out.logits.shape[-1] < ref_out.logits.shape[-1]
    logits = gather_from_parallel(out.logits, None, vocab) if result.vocab_parallel_logits else out.logits
    result.logits, logits_ok = max_error(logits, ref_out.logits)
    result.loss, loss_ok = max_error(out.loss, ref_out.loss)
    if not logits_ok:
        result.failures.append(f"logits differ by {result.logits:.2e}")
    if not loss_ok:
        result.failures.append(f"loss differs by {result.loss:.2e}")

    ref_out.loss.backward()
    out.loss.backward()
    for d in compare_params(ref, model, None, grads=True):
        if d.only_in is not None:
            result.failures.append(f"gradient of {d.name} is {'missing' if d.only_in == 'unsharded' else 'unexpected'}")
            continue
        result.grad = max(result.grad, d.error)
        if not d.ok:
            result.failures.append(f"gradient of {d.name} differs by {d.error:.2e}")

    ref.eval()
    model.eval()
    kwargs = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected, got = ref.generate(ids[:, :4], **kwargs), model.generate(ids[:, :4], **kwargs)
    result.generate_equal = got.shape == expected.shape and torch.equal(got, expected)
    if not result.generate_equal:
        result.failures.append("greedy generate differs")
    return result
