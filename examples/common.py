"""What the examples share: start-up, the engine, the training loop, saving and plots.

Every example trains (and runs inference) through :class:`shardformer.ParallelEngine`, so any
(tp, pp, dp, ZeRO) layout the config asks for runs the same code. Every function here runs on every
rank (the collective ones say so); only rank 0 prints and writes.
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

from shardformer import EngineConfig, ParallelEngine, ProcessMesh, init_distributed
from shardformer.checkpoint import gather_full_state, save_pretrained
from shardformer.core.config import PRECISIONS


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
    """Join the job started by ``shardformer run``, build the (pp, dp, cp, tp) mesh and seed every RNG."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the training bar is the one to watch
    device = init_distributed()
    mesh = ProcessMesh(
        cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.data_parallel_size, cfg.context_parallel_size,
        dp_replicate_size=cfg.dp_replicate,
    )  # fmt: skip
    seed_everything(cfg.seed)
    return Env(device, mesh, PRECISIONS[cfg.precision])


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


# -- the engine and the training loop -------------------------------------------------------------


def build_engine(model: torch.nn.Module, cfg, env: Env, *, train: bool = True, loss_fn=None) -> ParallelEngine:
    """Shard ``model`` for the job's (tp, pp, dp) layout; with ``train``, AdamW under ZeRO-``zero_stage``.

    Each optimizer step takes the global batch of ``batch_size`` rows: every dp rank its slice, cut
    into micro-batches of ``micro_batch_size`` rows (default: one micro-batch).
    """
    mesh = env.mesh
    per_rank = cfg.batch_size // mesh.dp_size
    if per_rank * mesh.dp_size != cfg.batch_size:
        raise ValueError(f"batch_size={cfg.batch_size} does not divide over data_parallel_size={mesh.dp_size}")
    micro = cfg.micro_batch_size or per_rank
    if per_rank % micro != 0:
        raise ValueError(f"micro_batch_size={micro} does not divide the {per_rank} rows each dp rank gets per step")
    config = EngineConfig(
        tp=mesh.tp_size,
        pp=mesh.pp_size,
        dp=mesh.dp_size,
        dp_replicate=mesh.dp_replicate_size,
        cp=mesh.cp_size,
        cp_mode=cfg.context_parallel_mode,
        zero_stage=cfg.zero_stage,
        num_microbatches=per_rank // micro if train else 1,
        schedule=cfg.schedule,
        virtual_stages=cfg.virtual_stages,
        precision=cfg.precision,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed,
        sequence_parallel=cfg.sequence_parallel,
        activation_checkpointing=cfg.activation_checkpointing and train,
    )
    optimizer = (lambda params: torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)) if train else None
    return ParallelEngine(model.to(env.device), optimizer, config, loss_fn=loss_fn, mesh=mesh)


def train(env: Env, cfg, engine: ParallelEngine, batch_of, unit: str = "samples") -> list[float]:
    """Run ``cfg.steps`` optimizer steps; ``batch_of(step) -> (global batch dict, items in it)``.

    Shows a progress bar on rank 0 with the loss (averaged over dp) and ``unit`` per second.
    Returns the loss of every step.
    """
    warmup = max(1, cfg.steps // 10)
    # Linear warm-up over the first 10% of the steps, then cosine decay to 10% of cfg.lr.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * s / max(1, cfg.steps))),
    )
    losses: list[float] = []
    bar = tqdm(total=cfg.steps, desc="train", unit="step", disable=not env.is_main, file=sys.stdout, mininterval=0.5)
    for step in range(cfg.steps):
        start = time.perf_counter()
        batch, items = batch_of(step)
        losses.append(engine.train_step(batch))
        schedule.step()
        rate = items / (time.perf_counter() - start)
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
    """Save a sharded HF model (any stage of it) as a plain HF folder (collective; global rank 0 writes)."""
    save_pretrained(model, path)


def save_state_dict(model: torch.nn.Module, path: str, meta: dict) -> None:
    """Save a sharded non-HF model (timm) as ``model.safetensors`` + ``meta.json`` (collective)."""
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
