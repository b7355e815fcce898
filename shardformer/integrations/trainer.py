"""``ShardedTrainer``: transformers' ``Trainer`` for a model sharded by shardformer, exact.

A plain ``Trainer`` cannot train a tensor-parallel model right: accelerate wraps it in DDP over every
rank (whose start-up broadcast copies rank 0's shards over the others', so sharded models refuse
DDP), every rank gets its own batch, and ``clip_grad_norm_`` sees one rank's slices. This subclass
changes exactly those places and leaves the rest of Trainer as it is:

- batches are split over data-parallel ranks only (tp ranks of one replica get the same batch);
- no DDP: each gradient is averaged over the dp group once per optimizer step (after the last
  micro-batch of gradient accumulation), as DDP would, and never over tp ranks;
- the gradient norm (for clipping and for the log) is the global one: tp slices summed, replicated
  weights counted once;
- evaluation and prediction see what the unsharded model gives: logits over the whole vocabulary,
  and each example once (gathered over dp ranks only, as tp ranks hold the same values);
- ``save_model`` and checkpoints write a plain HuggingFace folder through shardformer's export, plus
  one optimizer and RNG file per rank; ``resume_from_checkpoint`` restores model, optimizer, scheduler
  and every RNG (the tp dropout generators too) exactly; ``load_best_model_at_end`` restores the best
  checkpoint the same way;
- expert parallelism (``ShardConfig(expert_parallel_size=E)``): an expert's gradient already holds the
  tokens every ep rank sent it; it is summed over the ranks holding the same experts and divided by
  the dp size (dense gradients: averaged over dp), and the gradient norm adds every ep rank's experts.

Pipeline stages cannot run under Trainer's loop: such a model is refused before the first step.
"""

from __future__ import annotations

import functools
import math
import os
from contextlib import ExitStack

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import Trainer

from shardformer.checkpoint.gather import layout_of, refuse_context_parallel
from shardformer.checkpoint.reload import load_pretrained_into
from shardformer.core import comm
from shardformer.core.record import is_sharded, sharding_of
from shardformer.data_parallel.grad_norm import clip_master_grads, global_grad_norm
from shardformer.data_parallel.layout import ParamSlot
from shardformer.data_parallel.running_stats import check_recomputed_statistics, check_split_statistics
from shardformer.expert_parallel.layout import is_expert_param
from shardformer.tensor_parallel.layers import VocabParallelLMHead1D
from shardformer.tensor_parallel.lm_head import gathered_logits
from shardformer.tensor_parallel.recompute import recomputed_modules
from shardformer.tensor_parallel.regions import gather_from_parallel

_OPTIMIZER = "shardformer-optimizer-rank{}-of-{}.pt"  # each rank's optimizer state holds its own slices
_DROPOUT_RNG = "shardformer-dropout-rng-rank{}-of-{}.pt"  # the tp dropout layers' own generators
_SCHEDULER = "scheduler.pt"  # transformers' name, so its checkpoint tools find it


def sharded_root(model: nn.Module) -> nn.Module:
    """The module shardformer sharded: ``model`` itself, or the one inside a PEFT wrapper."""
    for module in model.modules():
        if is_sharded(module):
            return module
    raise ValueError(
        f"{type(model).__name__} was not sharded by shardformer; ShardedTrainer trains sharded models (use "
        f"transformers.Trainer for an unsharded one)"
    )


class ShardedTrainer(Trainer):
    """``transformers.Trainer`` for a shardformer-sharded model (tensor parallel, tensor x data parallel on
    the model's ProcessMesh). Takes exactly Trainer's arguments; see the module docstring for what differs."""

    def __init__(self, model: nn.Module | None = None, args=None, *rest, **kwargs):
        if model is None:
            raise ValueError("ShardedTrainer needs the sharded model itself (model_init is not supported)")
        root = sharded_root(model)
        info = sharding_of(root)
        if info.num_stages > 1:
            raise ValueError(
                f"{type(root).__name__} is split into {info.num_stages} pipeline stages; Trainer's loop runs one "
                f"forward per micro-batch on every rank and cannot drive a pipeline schedule; train it with "
                f"ParallelEngine, or shard it with pipeline_parallel_size=1 for ShardedTrainer"
            )
        self._layout = layout_of(root)  # refuses a tp group without a mesh when dp is unknown
        self._experts = info.experts  # the ExpertLayout where experts are split over ep ranks, else None
        refuse_context_parallel(self._layout, "ShardedTrainer")  # its data split knows dp and tp only
        check_split_statistics(root, "ShardedTrainer", {"dp": self._layout.dp})  # each dp rank sees its part only
        super().__init__(model, args, *rest, **kwargs)
        if self.args.gradient_checkpointing:  # transformers' checkpointing recomputes the layers it wraps
            check_recomputed_statistics(root, "ShardedTrainer", recomputed_modules(root, None))
        for option in ("fsdp", "deepspeed", "parallelism_config"):
            if getattr(self.args, option, None):
                raise ValueError(f"ShardedTrainer does its own parallelism; drop TrainingArguments.{option}")
        self._split_heads = [m for m in model.modules() if isinstance(m, VocabParallelLMHead1D) and not m.gather_output]
        if self._split_heads:
            _refuse_readers_of_split_logits(self)
        # The model owns its placement and gradient reduction: Trainer then prepares it without DDP,
        # calls _sync_replicated_trainable_parameters, and saves on every rank (the export is collective).
        self.is_distributed_loading_by_transformers = True
        self._dp_hooks = False

    # --- parallel sizes and data -------------------------------------------------------------

    def get_tp_size(self) -> int:
        return self._layout.tp

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        lay = self._layout
        if lay.world > 1:  # accelerate splits batches over the mesh's data dimensions only
            from torch.distributed.device_mesh import init_device_mesh

            self.accelerator.state.device_mesh = init_device_mesh(
                self.args.device.type, (lay.dp, lay.tp), mesh_dim_names=("dp_replicate", "tp")
            )
        # Evaluation gathers predictions and losses with gather_for_metrics, over every process: the tp
        # ranks of one replica would each add the same examples again. Gather over dp only instead.
        self.accelerator.gather_for_metrics = self._gather_for_metrics
        self.gather_function = functools.partial(
            self._gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
        )

    def _gather_for_metrics(self, data, use_gather_object: bool = False):
        """accelerate's gather_for_metrics over the dp group: the same trimming of the last batch's padding."""
        from accelerate.utils import recursively_apply

        lay, state = self._layout, self.accelerator.gradient_state
        if lay.dp > 1:
            try:
                recursively_apply(lambda x: x, data, error_on_other_type=True)
            except TypeError:
                use_gather_object = True
            if use_gather_object:
                parts = [None] * lay.dp
                dist.all_gather_object(parts, data, group=lay.dp_group)
                data = [item for part in parts for item in part]
            else:
                data = recursively_apply(functools.partial(_all_gather_rows, group=lay.dp_group), data)
        if state.end_of_dataloader and state.remainder > 0:  # examples the dataloader repeated to fill the batch
            if use_gather_object:
                return data[: state.remainder]
            return recursively_apply(lambda tensor: tensor[: state.remainder], data)
        return data

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's; outputs handed back to a caller (TRL's SFTTrainer logs entropy and accuracy from them)
        carry logits over the whole vocabulary, gathered without gradient."""
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not return_outputs or not self._split_heads:
            return result
        loss, outputs = result
        head = self._split_heads[-1]
        logits = outputs.get("logits") if hasattr(outputs, "get") else None
        if head.gather_output or logits is None or logits.shape[-1] != head.weight.shape[0]:
            return result  # gathered already (prediction_step), or not this head's logits
        with torch.no_grad():
            outputs["logits"] = gather_from_parallel(logits.detach(), head.process_group, head.out_features, 1)
        return loss, outputs

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Predictions over the whole vocabulary: the vocab-parallel heads gather their logits for the call."""
        with ExitStack() as stack:
            if not prediction_loss_only:
                for module in model.modules():
                    if isinstance(module, VocabParallelLMHead1D):
                        stack.enter_context(gathered_logits(module))
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    # --- gradients ----------------------------------------------------------------------------

    def _sync_replicated_trainable_parameters(self, model: nn.Module) -> None:
        """Average each gradient over the dp group at the end of each accumulation window (DDP's job)."""
        lay = self._layout
        if lay.dp == 1 or self._dp_hooks:
            return
        self._dp_hooks = True

        experts = self._experts

        def average(param: torch.Tensor) -> None:
            if self.accelerator.sync_gradients and param.grad is not None:
                # an expert's gradient holds every ep rank's tokens already: summed over the ranks holding
                # the same experts only, then divided by the whole dp size like the dense ones
                expert = experts is not None and is_expert_param(param)
                dist.all_reduce(param.grad, group=experts.expert_dp_group if expert else lay.dp_group)
                param.grad.div_(lay.dp)

        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(average)

    def _grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global gradient norm (tp slices summed, replicated weights once); clips when finite."""
        slots = [
            ParamSlot(i, p, p.numel(), p.numel(), p)
            for i, p in enumerate(model.parameters())
            if p.requires_grad and p.grad is not None
        ]
        if not slots:
            return torch.tensor(0.0)
        lay = self._layout
        tp_group = lay.tp_group if lay.tp > 1 else comm.LOCAL
        if self._experts is None:
            total, _ = global_grad_norm(slots, comm.LOCAL, tp_group, comm.LOCAL)  # dp already averaged
        else:  # each ep rank holds other experts: their squares are summed over the ep group
            dense = [s for s in slots if not is_expert_param(s.param)]
            experts = [s for s in slots if is_expert_param(s.param)]
            total = math.hypot(
                global_grad_norm(dense, comm.LOCAL, tp_group, comm.LOCAL)[0],
                global_grad_norm(experts, self._experts.ep_group, tp_group, comm.LOCAL)[0],
            )
        if max_norm != float("inf"):
            clip_master_grads(slots, total, max_norm)
        return torch.tensor(total)

    def _clip_grad_norm(self, model):
        return self._grad_norm(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return (grad_norm if grad_norm is not None else self._grad_norm(model, float("inf"))).item()

    # --- saving and resuming ------------------------------------------------------------------

    def _rank_file(self, folder: str, pattern: str) -> str:
        return os.path.join(folder, pattern.format(self._layout.rank, self._layout.world))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        torch.save(self.optimizer.state_dict(), self._rank_file(output_dir, _OPTIMIZER))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        file = self._rank_file(checkpoint, _OPTIMIZER)
        if not os.path.isfile(file):
            raise ValueError(
                f"{checkpoint} has no {os.path.basename(file)}: it was not written by ShardedTrainer on "
                f"{self._layout.world} ranks; resume on the world size it was saved from"
            )
        self.optimizer.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
        scheduler = torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        states = {name: m.get_rng_state() for name, m in self._dropouts()}
        torch.save(states, self._rank_file(output_dir, _DROPOUT_RNG))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        file = None if checkpoint is None else self._rank_file(checkpoint, _DROPOUT_RNG)
        if file is not None and os.path.isfile(file):
            states = torch.load(file, weights_only=True)
            for name, module in self._dropouts():
                module.set_rng_state(states[name])

    def _dropouts(self):
        return [(n, m) for n, m in self.model.named_modules() if callable(getattr(m, "get_rng_state", None))]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        root = sharded_root(model if model is not None else self.model)
        if hasattr(self.model, "peft_config"):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # the adapter: PEFT loads it
            return
        load_pretrained_into(root, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        # load_best_model_at_end: Trainer would load_state_dict the whole tensors into this rank's
        # slices; the best checkpoint is a folder resume reads, so it is read the same way.
        self._load_from_checkpoint(self.state.best_model_checkpoint)


def _all_gather_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    tensor = tensor[None] if tensor.dim() == 0 else tensor  # as accelerate's gather: scalars become rows
    return torch.cat(comm.all_gather(tensor, group))


def _refuse_readers_of_split_logits(trainer: Trainer) -> None:
    """What computes a loss from the logits inside the step would see this rank's slice of the vocabulary."""
    args, fix = trainer.args, "or shard the model with ShardConfig(gather_output=True) (whole logits on every rank)"
    reasons = []
    if trainer.compute_loss_func is not None:
        reasons.append("compute_loss_func computes the loss from the logits")
    if getattr(args, "label_smoothing_factor", 0):
        reasons.append(f"label_smoothing_factor={args.label_smoothing_factor} smooths the loss over the logits")
    if getattr(args, "use_liger_kernel", False):
        reasons.append("use_liger_kernel=True fuses the head with its own loss")
    if reasons:
        raise ValueError(
            f"the model's LM head is vocab-parallel (each rank holds logits over 1/{trainer._layout.tp} of the "
            f"vocabulary), but {'; '.join(reasons)}: drop it, {fix}"
        )
