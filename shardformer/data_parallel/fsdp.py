"""ZeRO-3 on PyTorch's FSDP2: parameters, gradients and optimizer state sharded over data parallelism.

``fully_shard`` (torch.distributed.fsdp) wraps each transformer layer of the stack and then the
model itself over the data-parallel sub-mesh (a 1-D DeviceMesh over this rank's dp group of the
ProcessMesh; 2-D under hybrid sharding: see `dp_device_mesh`). Every parameter becomes a DTensor
sharded on dim 0 over dp; a layer's parameters are
all-gathered just before its forward (and again for its backward), dropped afterwards, and its
gradients are reduce-scattered (averaged over dp, as DDP and our ZeRO-1/2 do). FSDP2 prefetches the
next layer's all-gather while the current one computes.

Tensor parallelism composes: our tp layers hold plain local-shard tensors, so FSDP2 shards those
local tensors over dp. Two things the sharder attached to the original parameters do not survive
``fully_shard`` replacing them, and are carried over here:

- ``param.shard_spec`` (how the tensor is cut over tp): set again on the new DTensor parameter, whose
  (global) shape is the tp-local shape, so checkpoints, export and the gradient norm read it as before;
- gradient hooks that sum a gradient over the tp group (sequence parallelism's split-region sums,
  per-head norms replicated over tp): FSDP2 computes gradients on new unsharded tensors that the hooks
  never see, so they run on the dp-reduced shard instead, once per step. A sum over tp commutes with
  the reduce-scatter over dp (tp peers hold the same rows of the same parameter), so this is exact.
  Key/value heads replicated over tp ranks (``ShardSpec.splits``) sum pieces at tp-local offsets that
  a dp shard does not keep; they are refused.

FSDP2 cannot shard a 0-dim parameter (CLIP's ``logit_scale``, SigLIP's ``logit_bias``): such scalars
are left out of ``fully_shard`` (``ignored_params``), kept whole on every dp rank as ZeRO-1 keeps its
replicated weights, and their gradients averaged over dp by a hook run with the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from shardformer.core import comm
from shardformer.core.counting import count_torch_collectives
from shardformer.core.record import is_sharded, sharding_of
from shardformer.core.shard_spec import shard_spec

GradHooks = list[tuple[nn.Parameter, list[Callable]]]


def dp_device_mesh(mesh, device: torch.device) -> DeviceMesh:
    """The DeviceMesh over this rank's data-parallel group of ``mesh`` (a ProcessMesh): 1-D, or at
    ``dp_replicate_size`` > 1 the 2-D (replicate, shard) mesh on which ``fully_shard`` is HSDP (shards
    inside the shard group, replicas across). A model on the meta device (a simulated job,
    tools/simulate) gets a CPU mesh: FSDP2 takes its device from the mesh and has no device handle for
    "meta"; the parameters stay on meta."""
    return _sub_mesh(mesh, mesh.dp_group, mesh.dp_shard_group, device, "dp")


def _sub_mesh(mesh, group, shard_group, device: torch.device, name: str) -> DeviceMesh:
    """The 1-D DeviceMesh over ``group``, or under hybrid sharding the 2-D (replicate, shard) one: its
    ranks in dp order are the replicas' shard groups one after the other."""
    device_type = "cpu" if device.type == "meta" else device.type
    if mesh.dp_replicate_size == 1:
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=(name,))
    ranks = torch.tensor(dist.get_process_group_ranks(group)).view(mesh.dp_replicate_size, -1)
    return DeviceMesh.from_group(
        [mesh.dp_replicate_group, shard_group], device_type, ranks, mesh_dim_names=("dp_replicate", f"{name}_shard"),
    )  # fmt: skip


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16: layers compute in bf16 from the fp32 sharded parameters, gradients are reduced in fp32."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def check_fully_shardable(model: nn.Module) -> None:
    """Refuse, before any collective, what ZeRO-3 here cannot shard exactly."""
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        if spec is not None and spec.splits and p.requires_grad:
            raise ValueError(
                f"zero_stage=3: {name} holds key/value heads replicated over {spec.world_size} tensor-parallel "
                f"ranks (fewer heads than tp), whose gradient sum cannot run on a data-parallel shard; use a "
                f"tensor_parallel_size that divides the number of key/value heads, or zero_stage=1 or 2"
            )
        if p.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"zero_stage=3: {name} is {p.dtype}; the sharded parameters are the fp32 master weights (FSDP2 "
                f"casts them for compute): load the model in fp32 and pick the compute dtype with precision="
            )


def kept_whole(param: torch.Tensor) -> bool:
    """A parameter ZeRO-3 keeps whole on every dp rank: a scalar, which FSDP2 cannot shard."""
    return param.dim() == 0


def _dp_mean(group, size: int) -> Callable:
    """A gradient hook: the gradient of a parameter kept whole, averaged over the dp ranks (FSDP2 averages
    the sharded ones in backward)."""

    def mean(grad: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(grad, group).div_(size)

    return mean


def fully_shard_model(
    model: nn.Module, layers: nn.Module | None, mesh, device: torch.device, precision: str = "fp32"
) -> GradHooks:
    """Apply FSDP2 to each module of ``layers`` (the repeated layer stack; None: the model as one unit)
    and to ``model``, over ``mesh``'s dp group. Returns the gradient hooks to run on the sharded
    gradients (see the module docstring); ``shard_spec`` is carried to the new parameters."""
    check_fully_shardable(model)
    count_torch_collectives()  # FSDP2 issues its collectives itself: counters see them through a dispatch mode
    specs = {name: shard_spec(p) for name, p in model.named_parameters()}
    expert_specs = {name: p.expert_spec for name, p in model.named_parameters() if hasattr(p, "expert_spec")}
    hooks = {name: list(p._backward_hooks.values()) for name, p in model.named_parameters() if p._backward_hooks}
    dp_mesh = dp_device_mesh(mesh, device)
    policy = mixed_precision(precision)
    whole = {p for p in model.parameters() if kept_whole(p)}
    _shard_experts(model, mesh, device, policy)
    for layer in layers if layers is not None else ():
        if layer is not None:
            fully_shard(layer, mesh=dp_mesh, mp_policy=policy, ignored_params=whole & set(layer.parameters()))
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, ignored_params=whole)
    out: GradHooks = []
    for name, p in model.named_parameters():
        if specs[name] is not None:
            p.shard_spec = specs[name]
        if name in expert_specs:
            p.expert_spec = expert_specs[name]
        mean = [_dp_mean(mesh.dp_group, mesh.dp_size)] if p in whole and p.requires_grad and mesh.dp_size > 1 else []
        if name in hooks or mean:
            out.append((p, mean + hooks.get(name, [])))
    return out


def _shard_experts(model: nn.Module, mesh, device: torch.device, policy) -> None:
    """Experts split by expert parallelism: each experts module its own FSDP2 unit over the ranks holding
    the same experts (expert-dp; hybrid sharding: sharded in the shard group's, replicated across), its
    gradients divided by the whole dp size (they already hold the tokens of every ep rank), as dense
    gradients are averaged over dp."""

    experts = sharding_of(model).experts if is_sharded(model) else None
    if experts is None:
        return
    expert_mesh = _sub_mesh(mesh, mesh.expert_dp_group, mesh.expert_dp_shard_group, device, "expert_dp")
    for path in experts.paths:
        try:
            module = model.get_submodule(path)
        except AttributeError:  # a layer of another pipeline stage
            continue
        fully_shard(module, mesh=expert_mesh, mp_policy=policy)
        module.set_gradient_divide_factor(float(mesh.dp_size))
        # a shard over 2+ ranks: a sum, then the division (gloo has no pre-scaled sum); a shard of one rank:
        # FSDP2 divides while copying (then sums over the replicas), and forcing the sum would divide a
        # second time (torch 2.14)
        module.set_force_sum_reduction_for_comms(mesh.expert_dp_shard_size > 1)


def through_root(stage_forward: Callable, calls_the_model: bool = False) -> Callable:
    """``stage_forward(model, hidden, inputs)`` run as the call of ``model`` itself: a stage forward
    calls submodules directly, but FSDP2's root hooks (lazy set-up, gathering the root's own
    parameters, the end-of-backward reshard and gradient wait) run only when the root is called.

    ``calls_the_model``: the stage forward is the model's own call (pp=1 without a hand-written
    stage forward: plan and derived routes, PEFT), which runs the root's hooks already; installing
    it as the model's forward would make it call itself forever."""

    def run(model: nn.Module, hidden, inputs: dict):
        if calls_the_model:
            out = stage_forward(model, hidden, inputs)
            if not torch.is_grad_enabled():
                reshard(model)
            return out
        saved = model.__dict__.get("forward")
        entered = []

        def as_root(**kwargs):
            if entered:  # a stage forward that calls the whole model on some stages: say so, not RecursionError
                raise NotImplementedError(
                    f"zero_stage=3: the stage forward {getattr(stage_forward, '__name__', stage_forward)!r} calls "
                    f"the whole {type(model).__name__} itself, which ZeRO-3 cannot wrap in a pipeline stage yet; "
                    f"use zero_stage=1 or 2, or pipeline_parallel_size=1"
                )
            entered.append(True)
            return stage_forward(model, hidden, kwargs)

        model.forward = as_root
        try:
            out = model(**inputs)
        finally:
            if saved is None:
                del model.forward
            else:
                model.forward = saved
        if not torch.is_grad_enabled():  # no backward will reshard the root: its gathered weights go now
            reshard(model)
        return out

    return run


def sync_in_last_backward(model: nn.Module, num_microbatches: int, spec=None, chunks=None) -> Callable | None:
    """The pipeline's ``before_backward(last, stage)`` at ZeRO-3 with micro-batches: FSDP2 accumulates the
    unsharded gradients of all but the stage's last micro-batch and reduce-scatters once, in the last
    backward (ZeRO-1/2 count backward passes themselves: ``backwards_per_step``). With several chunks per
    rank (``chunks``, split by the pipeline ``spec``; ``stage``: the chunk whose backward comes), each
    chunk's layer units wait for that chunk's last backward; the root's own parameters (embedding, norm,
    head), which two chunks may share, are reduce-scattered in every backward that reaches them (exact:
    FSDP2 adds each reduced part to the sharded gradient). None with one micro-batch: nothing to hold."""
    if num_microbatches == 1:
        return None

    def before_backward(last: bool, stage: int | None = None) -> None:
        if chunks is None:
            model.set_requires_gradient_sync(last)
            return
        model.set_requires_gradient_sync(True, recurse=False)
        paths = spec.layer_paths(model)
        for i in chunks.layers[chunks.indices.index(stage)]:
            model.get_submodule(paths[i]).set_requires_gradient_sync(last)

    return before_backward


def reshard(model: nn.Module) -> None:
    """Drop every gathered parameter of ``model``'s FSDP2 units, so the model holds (and its state
    dict shows) its dp shards again: the root stays gathered after a forward without backward."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_of(tensor: torch.Tensor) -> torch.Tensor:
    """A ZeRO-3 (DTensor) parameter gathered over dp (or expert-dp), with its ``shard_spec`` and
    ``expert_spec``; other tensors as they are.
    Collective over the dp group for a DTensor."""
    if not isinstance(tensor, DTensor):
        return tensor
    full = tensor.detach().full_tensor()
    for layout in ("shard_spec", "expert_spec"):  # how it is cut over tp, and over ep
        if getattr(tensor, layout, None) is not None:
            setattr(full, layout, getattr(tensor, layout))
    return full


@torch.no_grad()
def copy_full_into(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.copy_(value)`` where ``value`` is the full (dp-gathered) tensor; a DTensor takes its
    own shard of it, locally (every rank holds the same ``value``)."""
    if isinstance(tensor, DTensor):
        value = distribute_tensor(
            value.to(tensor.device, tensor.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None
        )
    tensor.copy_(value)


def local_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of what this rank stores for ``tensor`` (a DTensor's local shard)."""
    return tensor.to_local().shape if isinstance(tensor, DTensor) else tensor.shape


def local_numel(tensor: torch.Tensor) -> int:
    """Elements this rank stores for ``tensor`` (a DTensor's local shard only)."""
    return tensor.to_local().numel() if isinstance(tensor, DTensor) else tensor.numel()


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for ``tensor`` (a DTensor's local shard only)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()
