"""What the examples share: start-up, sharding, the optimizer, the training loop, saving and plots.

Every function here runs on every rank (the collective ones say so); only rank 0 prints and writes.
"""

# ruff: noqa: E402 (the environment is set before transformers can be imported)

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the examples never reach the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from shardformer import ProcessMesh, ShardConfig, init_distributed, shard_model
from shardformer.slicer import shard_spec
from shardformer.zero import ZeroOptimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Env:
    """This process's place in the job: its device, the process mesh and the parameter dtype."""

    device: torch.device
    mesh: ProcessMesh
    dtype: torch.dtype

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def is_main(self) -> bool:
        return self.mesh.rank == 0


def setup(cfg) -> Env:
    """Join the job started by ``shardformer run``, build the (dp, tp) mesh and seed every RNG."""
    if cfg.pipeline_parallel_size != 1:
        raise ValueError(f"pipeline_parallel_size={cfg.pipeline_parallel_size}: the examples use tp and dp only; set 1")
    if cfg.precision != "fp32" and cfg.zero_stage == 0:
        raise ValueError(f"precision={cfg.precision!r} needs fp32 master weights: set zero_stage=1 or 2")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the training bar is the one to watch
    device = init_distributed()
    mesh = ProcessMesh(tp_size=cfg.tensor_parallel_size, dp_size=cfg.data_parallel_size)
    seed_everything(cfg.seed)
    return Env(device, mesh, DTYPES[cfg.precision])


def finish() -> None:
    """Leave the job cleanly (every rank)."""
    dist.barrier()
    dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def log(env: Env, message: str) -> None:
    """Print on rank 0 only (every rank computes the same thing; one copy is enough)."""
    if env.is_main:
        print(message, flush=True)


def output_paths(cfg) -> dict[str, str]:
    """Where a run writes: the initial model, the trained checkpoint, metrics and the plot."""
    out = cfg.output_dir
    return {
        "initial": os.path.join(out, "initial"),
        "checkpoint": cfg.checkpoint_dir or os.path.join(out, "checkpoint"),
        "metrics": os.path.join(out, "metrics.json"),
        "plot": os.path.join(out, "loss_curve.png"),
        "predictions": os.path.join(out, "inference.json"),
    }


def on_rank_zero(env: Env, fn, *args) -> None:
    """Run ``fn(*args)`` on rank 0 (writing files, say) while the others wait for it."""
    if env.is_main:
        fn(*args)
    dist.barrier()


# -- sharding and the optimizer ------------------------------------------------------------------


def shard(model: torch.nn.Module, cfg, env: Env) -> torch.nn.Module:
    """Move ``model`` to this rank's device and dtype, then cut it for tensor parallelism."""
    model = model.to(device=env.device, dtype=env.dtype)
    config = ShardConfig(
        tensor_parallel_size=cfg.tensor_parallel_size,
        data_parallel_size=env.mesh.dp_size,
        seed=cfg.seed,
        mesh=env.mesh,
    )
    return shard_model(model, config)


def build_optimizer(model: torch.nn.Module, cfg, env: Env) -> torch.optim.Optimizer:
    """AdamW; wrapped in ZeRO over the data-parallel group when ``zero_stage`` > 0."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.zero_stage == 0:
        return optimizer
    tp_group = env.mesh.tp_group if env.mesh.tp_size > 1 else None
    return ZeroOptimizer(optimizer, env.mesh.dp_group, stage=cfg.zero_stage, tp_group=tp_group, model=model)


def _sync_and_clip(model: torch.nn.Module, cfg, env: Env) -> None:
    """Without ZeRO: average gradients over dp and clip them to the global (tp-aware) norm."""
    grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    if env.mesh.dp_size > 1:
        for _, grad in grads:
            dist.all_reduce(grad, group=env.mesh.dp_group)
            grad.div_(env.mesh.dp_size)
    if cfg.max_grad_norm is None:
        return
    # Shards of one tensor add up over tp; replicated params count once (tp rank 0's copy).
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    for p, grad in grads:
        total[0 if shard_spec(p) is not None else 1] += grad.double().square().sum()
    if env.mesh.tp_rank != 0:
        total[1] = 0
    dist.all_reduce(total, group=env.mesh.tp_group)
    norm = total.sum().sqrt().item()
    if norm > cfg.max_grad_norm:
        for _, grad in grads:
            grad.mul_(cfg.max_grad_norm / (norm + 1e-6))


def train(env: Env, cfg, model: torch.nn.Module, optimizer, step_loss, unit: str = "samples") -> list[float]:
    """Run ``cfg.steps`` optimizer steps; ``step_loss(step) -> (loss, items on this rank)``.

    Shows a progress bar on rank 0 with the loss (averaged over dp) and ``unit`` per second (all
    ranks of one tp group work on the same items, so the rate counts each dp replica once).
    Returns the loss of every step.
    """
    model.train()
    zero = isinstance(optimizer, ZeroOptimizer)
    warmup = max(1, cfg.steps // 10)
    # Linear warm-up over the first 10% of the steps, then cosine decay to 10% of cfg.lr.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * s / max(1, cfg.steps)))
    )
    losses: list[float] = []
    bar = tqdm(total=cfg.steps, desc="train", unit="step", disable=not env.is_main, file=sys.stdout, mininterval=0.5)
    for step in range(cfg.steps):
        start = time.perf_counter()
        loss, items = step_loss(step)
        if zero:
            optimizer.backward(loss)
            if cfg.max_grad_norm is not None:
                optimizer.clip_grad_norm(cfg.max_grad_norm)
        else:
            loss.backward()
            _sync_and_clip(model, cfg, env)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        value = loss.detach().float()
        if env.mesh.dp_size > 1:
            dist.all_reduce(value, group=env.mesh.dp_group)
            value /= env.mesh.dp_size
        losses.append(value.item())
        rate = items * env.mesh.dp_size / (time.perf_counter() - start)
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            bar.set_postfix({"loss": f"{losses[-1]:.3f}", f"{unit}/s": f"{rate:,.0f}"})
    bar.close()
    return losses


def report_training(env: Env, cfg, losses: list[float], title: str) -> None:
    """Rank 0: print the loss summary, write ``metrics.json`` and the loss-curve PNG."""
    if not env.is_main or not losses:
        return
    paths = output_paths(cfg)
    window = max(1, min(5, len(losses) // 4))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    metrics = {"steps": len(losses), "losses": losses, "first_loss": first, "last_loss": last}
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(paths["metrics"], "w") as file:
        json.dump(metrics, file, indent=1)
    plot_losses(losses, paths["plot"], title)
    print(f"loss {first:.3f} -> {last:.3f} (mean of the first / last {window} steps)", flush=True)
    print(f"wrote {paths['metrics']} and {paths['plot']}", flush=True)


def plot_losses(losses: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(env: Env, path: str, data) -> None:
    if env.is_main:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as file:
            json.dump(data, file, indent=1)


# -- saving and loading --------------------------------------------------------------------------


def save_model(model: torch.nn.Module, path: str) -> None:
    """Save a sharded HF model as a plain HF folder (collective; global rank 0 writes)."""
    from shardformer.checkpoint import save_pretrained

    save_pretrained(model, path)


def save_state_dict(model: torch.nn.Module, path: str, meta: dict) -> None:
    """Save a sharded non-HF model (timm) as ``model.safetensors`` + ``meta.json`` (collective)."""
    from shardformer.checkpoint.gather import gather_full_state

    state = gather_full_state(model)  # the full model on global rank 0, None elsewhere
    if dist.get_rank() == 0:
        write_state_dict(state, meta, path)
    dist.barrier()


def write_state_dict(state: dict[str, torch.Tensor], meta: dict, path: str) -> None:
    """Write ``model.safetensors`` and ``meta.json`` (what the model is built from) into ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "meta.json"), "w") as file:
        json.dump(meta, file, indent=1)


def load_state_dict(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """What :func:`save_state_dict` wrote: the weights and the metadata."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "meta.json")) as file:
        meta = json.load(file)
    return load_file(os.path.join(path, "model.safetensors")), meta


def run_inference(cfg, env: Env, make_initial_model, run, show, results: dict | None = None) -> None:
    """Run ``run(folder)`` on the trained model and, when asked (or with no checkpoint yet), on the
    untrained one; ``show(which, result)`` prints each; everything goes to inference.json."""
    paths = output_paths(cfg)
    results = dict(results or {})
    trained = has_checkpoint(paths["checkpoint"])
    if not trained:
        log(env, f"no checkpoint in {paths['checkpoint']} yet (run --mode train); using the untrained model")
    if cfg.compare_untrained or not trained:
        if not has_checkpoint(paths["initial"]):
            make_initial_model(cfg, env, paths["initial"])
        results["untrained"] = run(paths["initial"])
        show("untrained", results["untrained"])
    if trained:
        results["trained"] = run(paths["checkpoint"])
        show("trained", results["trained"])
    write_json(env, paths["predictions"], results)


def has_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(os.path.join(path, "meta.json"))
