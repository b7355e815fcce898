"""The bytes one simulated rank holds (`shardformer.tools.simulate`), read off the rank built on the meta device.

A training step of one micro-batch through the engine's stage gives the model state held at the end of
its backward (parameters, their gradients, the reducer's bucket buffers, the optimizer's masters and
states, each storage once) and the bytes its forward and loss saved for the backward, with attention
run as the fused kernel a GPU runs keeps it. ZeRO-3 runs no step on meta: its shards are read from the
rank built with FSDP2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardformer.core.memory import StorageBytes
from shardformer.engine import ParallelEngine


def zero3_bytes(factory, config) -> dict[str, int]:
    """This rank at ZeRO-3 built for real: ``ParallelEngine`` shards the meta model over tp and applies
    FSDP2's ``fully_shard`` per layer over the dp sub-mesh of the fake group. FSDP2 refuses to run
    forward on meta parameters (its lazy init wants them materialised), so each sharded parameter is
    given the gradient FSDP2's reduce-scatter leaves (its own DTensor layout: this rank's dp rows) and
    AdamW steps once, creating its state. Bytes are the local shards, each storage once."""

    with torch.device("meta"):
        model = factory()
    engine = ParallelEngine(model, lambda p: torch.optim.AdamW(p, lr=1e-4), config)
    params = list({id(p): p for p in engine.model.parameters()}.values())
    for p in params:
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    size = StorageBytes()
    states = [v for st in engine.optimizer.optim.state.values() for v in st.values() if torch.is_tensor(v)]
    return {
        "parameters": size(params),
        "gradients": size(p.grad for p in params),
        "optimizer (Adam + master)": size(states),
    }


def step_bytes(engine, batch: int, seq: int, hidden_size: int) -> tuple[dict[str, int], int]:
    """One training step of one micro-batch through the engine's stage: the bytes held at the end of
    backward, and the bytes its forward and loss saved for the backward."""
    mesh, model, zero = engine.mesh, engine.model, engine.optimizer
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    inputs = {
        "input_ids": ids,
        "labels": ids,
        # given whole, so transformers builds no mask from values (a meta tensor has none)
        "attention_mask": torch.ones(batch, 1, seq, seq, dtype=torch.bool, device="meta"),
        "position_ids": torch.zeros(batch, seq, dtype=torch.long, device="meta"),
    }
    hidden = None
    if not mesh.is_first_stage:
        dtype = next(model.parameters()).dtype
        hidden = torch.empty(batch, seq, hidden_size, dtype=dtype, device="meta", requires_grad=True)
    model.train()
    with saved_activations(model, hidden) as saved:
        out = engine.stage_forward(model, hidden, inputs)
        loss = engine.loss_fn(out, inputs) if mesh.is_last_stage else None
    if loss is not None:
        loss.backward()
    else:
        out.backward(torch.empty_like(out))
    engine._sum_shared_grads()  # tied weights over the first and last stage, as train_step does
    held = _held_bytes(model, zero)
    zero.step()
    return held, saved.bytes


class _FusedAttentionOnMeta(TorchFunctionMode):
    """On meta tensors ``F.scaled_dot_product_attention`` always takes its math path, which keeps the
    attention probabilities (b x heads x s x s); a GPU (and a CPU) runs a fused kernel that keeps q, k,
    v, the output and a log-sum-exp. Run the fused kernel's own meta function instead (CPU flash
    attention's: the same tensors as CUDA's flash kernel, key/value heads not repeated), without the
    simulation's all-ones mask, so the saved bytes are a training step's without a padding mask.
    Attention whose values have another head size than its queries (DeepSeek's MLA) keeps the math
    path: its measured activations include the probabilities a fused kernel would not keep."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            a = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args)) | kwargs
            q, v = a["query"], a["value"]  # its meta function assumes v's head size is q's (not MLA's)
            if q.is_meta and not a.get("dropout_p") and q.shape[-1] == v.shape[-1]:
                fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
                return fused(a["query"], a["key"], a["value"], 0.0, True, scale=a.get("scale"))[0]
        return func(*args, **kwargs)


class saved_activations:  # noqa: N801 - used as a context manager, like torch's
    """Inside: count the bytes autograd saves for the backward (each storage once; parameters and the
    stage's received input aside), with fused attention on meta (`_FusedAttentionOnMeta`)."""

    def __init__(self, model, received=None):
        self.skip = {p.untyped_storage()._cdata for p in model.parameters()}
        if received is not None:
            self.skip.add(received.untyped_storage()._cdata)
        self.storages: dict[int, int] = {}

    def _pack(self, t):
        storage = t.untyped_storage()
        if storage._cdata not in self.skip:
            self.storages[storage._cdata] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.mode = _FusedAttentionOnMeta()
        self.hooks.__enter__()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _held_bytes(model, zero) -> dict[str, int]:
    """Bytes of the parameters, their gradients, the reducer's bucket buffers and the optimizer's
    masters and states, each storage counted once (a master that views a buffer is not counted twice)."""
    size = StorageBytes()
    params = list(model.parameters())
    held = {"parameters": size(params), "gradients": size(p.grad for p in params if p.grad is not None)}
    parts = getattr(zero, "parts", (zero,))  # ep > 1: dense and experts' ZeroOptimizers
    # the [dp, row] buffers and reduce-scatter outputs held now
    buffers = [b for part in parts for b in part.reducer.held_buffers()]
    if buffers:
        held["gradient buffers (fp32)"] = size(buffers)
    states = [v for part in parts for st in part.optim.state.values() for v in st.values() if torch.is_tensor(v)]
    held["optimizer (Adam + master)"] = size([s.master for part in parts for s in part.slots] + states)
    return held
