"""Cross-entropy over vocabulary-parallel logits, without gathering them.

loss = log(sum_v exp(z_v)) - z_target, computed on each rank's vocabulary shard with three
all-reduces of one number per token (max, target logit, sum of exponentials). A rank never holds
more than its ``[tokens, vocab / tp]`` slice; the math is fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardformer.core.comm import all_reduce, group_rank, group_size
from shardformer.core.index_check import check_indices


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, ignore_index, group):
        local_vocab = logits.shape[-1]
        start = group_rank(group) * local_vocab
        valid = max(0, min(local_vocab, vocab_size - start))  # columns past the true vocabulary are padding

        z = logits.float()
        if valid < local_vocab:
            z = z.clone()  # .float() of fp32 logits is the caller's tensor: never write into it
            z[:, valid:] = float("-inf")
        z_max = z.max(dim=-1).values
        z_max = all_reduce(z_max, group, dist.ReduceOp.MAX)
        shifted = z - z_max.unsqueeze(-1)

        local_target = target - start
        here = (local_target >= 0) & (local_target < valid)
        local_target = local_target.masked_fill(~here, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        target_logit = all_reduce(target_logit, group)

        exp = shifted.exp_()  # padding columns were -inf: exp gives exactly 0
        sum_exp = exp.sum(dim=-1)
        sum_exp = all_reduce(sum_exp, group)

        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, here & ~ignored, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        softmax, local_target, hit, ignored = ctx.saved_tensors
        grad = softmax  # reused in place: d loss / d z = softmax - one_hot(target)
        # -1 at each target this rank holds, -0 (which changes nothing) elsewhere: no data-dependent
        # shape (boolean indexing), so torch.compile traces it without a graph break
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    process_group=None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-parallel ``logits`` ``[..., vocab / tp]`` against global ``labels`` ``[...]``.

    ``vocab_size`` is the true vocabulary (columns beyond it are padding and never count); it
    defaults to ``logits.shape[-1] * tp``. Labels equal to ``ignore_index`` contribute nothing;
    ``"mean"`` divides by the number of the others, as ``F.cross_entropy`` does.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree before the vocab dim")
    world = group_size(process_group)
    vocab_size = vocab_size or logits.shape[-1] * world
    check_indices(
        labels, vocab_size, "labels",
        "F.cross_entropy raises on them (here they would give a wrong loss); use labels from the model's own "
        f"tokenizer, and mark positions to skip with {ignore_index}",
        ignore_index,
    )  # fmt: skip
    losses = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), vocab_size, ignore_index, process_group
    )
    if reduction == "none":
        return losses.view(labels.shape)
    total = losses.sum()
    return total if reduction == "sum" else total / (labels != ignore_index).sum()
