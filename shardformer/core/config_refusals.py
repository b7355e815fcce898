"""The combinations of settings not proven exact here, refused when a config is built, one function per
technique (its refusals next to each other, each naming the fix). ShardConfig and EngineConfig call
them from ``__post_init__``, after every field's own check, before anything runs."""

from __future__ import annotations

from typing import Any

from shardformer.core.choices import VIRTUAL_SCHEDULES


def refuse_without_mesh(config: Any) -> None:
    """ShardConfig: expert and context parallelism need a process mesh, not a tensor-parallel group."""
    if config.tensor_parallel_process_group is None:
        return
    if config.expert_parallel_size > 1:
        raise ValueError(
            f"expert_parallel_size={config.expert_parallel_size} needs a process mesh (ep ranks are drawn "
            f"from the data-parallel ranks), but tensor_parallel_process_group was given; leave it out"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            f"context_parallel_size={config.context_parallel_size} needs a process mesh, but "
            f"tensor_parallel_process_group was given; leave it out (a mesh is built from the sizes) "
            f"or pass mesh=ProcessMesh(..., cp_size={config.context_parallel_size})"
        )


def refuse_context_parallel(config: Any) -> None:
    """EngineConfig at cp > 1: no torch.compile (the attention communicates from inside)."""
    if config.cp > 1 and config.compile:
        raise ValueError(
            f"EngineConfig.cp={config.cp} with compile=True is not supported: ring and all-to-all attention "
            f"communicate from inside attention, which torch.compile does not trace; use compile=False"
        )


def check_virtual_stages(config: Any) -> None:
    """EngineConfig: several model chunks per pp rank only with the schedules that run them, on torch's backend."""
    virtual, v = config.schedule in VIRTUAL_SCHEDULES, config.virtual_stages
    if not virtual and v not in (None, 1):
        raise ValueError(
            f"EngineConfig.virtual_stages={v} with schedule={config.schedule!r}: one chunk per rank runs "
            f"1f1b/gpipe; use schedule='interleaved_1f1b' (or 'zbv' / 'dualpipev' with 2) or virtual_stages=1"
        )
    if config.schedule in ("zbv", "dualpipev") and v not in (None, 2):
        raise ValueError(
            f"EngineConfig.virtual_stages={v} with schedule={config.schedule!r}: its V shape holds exactly 2 "
            f"chunks per rank; use virtual_stages=2 (or leave it out), or schedule='interleaved_1f1b'"
        )
    if virtual and config.pp > 1 and config.backend != "torch":
        raise ValueError(
            f"EngineConfig.schedule={config.schedule!r} with backend={config.backend!r}: it runs on "
            f"torch.distributed.pipelining only; use backend='torch', or schedule='1f1b' / 'gpipe'"
        )
    if virtual and config.pp > 1 and config.compile:
        raise ValueError(
            f"EngineConfig.schedule={config.schedule!r} with compile=True: a rank's chunks run the one model "
            f"under different views, which torch.compile does not trace; use compile=False or schedule='1f1b'"
        )


def refuse_zero3(config: Any) -> None:
    """EngineConfig at zero_stage=3: what ZeRO-3 (FSDP2) is not proven with here."""
    if config.zero_stage != 3:
        return
    _refuse(config, "zero_stage=3", {
        "precision": (
            config.precision == "fp16",
            "fp16 needs loss scaling, which stage 3 does not offer; use precision='bf16' (FSDP2 computes in "
            "bf16 from fp32 shards and reduces gradients in fp32) or zero_stage=1 or 2",
        ),
        "compile": (
            config.compile,
            "torch.compile is not tested with FSDP2 here; use compile=False or zero_stage=1 or 2",
        ),
        "cp": (
            config.cp > 1,
            "context parallelism sums gradients over cp with hooks on the parameters FSDP2 replaces; not "
            "proven together yet: use zero_stage=1 or 2 with cp, or cp=1",
        ),
    })  # fmt: skip


def refuse_expert_parallel(config: Any) -> None:
    """EngineConfig at ep > 1: what expert parallelism is not proven with here."""
    if config.ep == 1:
        return
    _refuse(config, f"ep={config.ep}", {
        "precision": (
            config.precision == "fp16",
            "fp16's loss scaling is not shared by the dense and expert optimizers yet; use precision='bf16'",
        ),
    })  # fmt: skip


def _refuse(config: Any, technique: str, refused: dict[str, tuple[bool, str]]) -> None:
    """Raise for the first ``{field: (refused, fix)}`` that is refused, naming the field, its value and the fix."""
    for name, (bad, fix) in refused.items():
        if bad:
            raise ValueError(f"EngineConfig.{name}={getattr(config, name)!r} with {technique}: {fix}")
