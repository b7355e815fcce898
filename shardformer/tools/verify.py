"""``shardformer.tools.verify``: run a model unsharded and sharded on the same inputs and say where they part.

On ``tp`` local gloo processes every rank builds the same model (rank 0's weights broadcast), keeps
an unsharded copy, shards the other with the given policy, and compares on the same random inputs:
outputs, loss, every gathered gradient, the weights and outputs after one SGD step, greedy
``generate``. Forward hooks record every module's output in both models; sharded activations are
gathered back (split dim, fused blocks and padding from the layer's ShardSpec), so a failure names
**the first module whose output diverges** and by how much. It is how a custom policy is finished.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any

import torch
import torch.distributed as dist

from shardformer.api import shard_model
from shardformer.core.compare import (
    ATOL,
    GRAD_ATOL,
    GRAD_RTOL,
    RTOL,
    call_on_own_inputs,
    compare_params,
    gather_like,
    max_error,
)
from shardformer.core.config import ShardConfig, check_positive_int
from shardformer.core.divergence import ActivationRecorder, Divergence, first_divergence, first_tensor
from shardformer.core.float64_mode import Float64Everywhere
from shardformer.models import inputs_for
from shardformer.policies.copies import no_dropout
from shardformer.tensor_parallel.regions import gather_from_parallel
from shardformer.tools.model_source import build_model, check_model_source, load_policy
from shardformer.tools.testing import run_on_ranks
from shardformer.tools.verify_pipeline import verify_pipeline_on_this_rank
from shardformer.tools.verify_report import (
    LR,
    Check,
    VerifyReport,
    broadcast_weights,
    excuse_rounding,
    merge_reports,
    params_check,
    route_name,
)

__all__ = [
    "ATOL",
    "GRAD_ATOL",
    "GRAD_RTOL",
    "LR",
    "RTOL",
    "ActivationRecorder",
    "Check",
    "Divergence",
    "VerifyReport",
    "first_divergence",
    "gather_like",
    "max_error",
    "merge_reports",
    "verify",
    "verify_on_this_rank",
]

BATCH, SEQ, NEW_TOKENS = 2, 8, 4
# the step that names a model whose backward refuses eval mode: checked again in training mode
EVAL_BACKWARD = "backward in eval mode of the unsharded model"


# -- comparing activations --------------------------------------------------------------------------


# -- one rank ---------------------------------------------------------------------------------------


def _loss_and_output(model, inputs, weights, group, full_shape):
    """The model's loss when it returns one, else ``sum(output * weights)`` on the gathered output."""
    out = call_on_own_inputs(model, inputs)
    main = first_tensor(out)
    loss = out.get("loss") if isinstance(out, dict) else None
    if group is not None and main.shape != full_shape:
        if main.shape[:-1] != full_shape[:-1]:
            raise ValueError(f"sharded output {list(main.shape)} cannot be gathered to {list(full_shape)}")
        main = gather_from_parallel(main, group, full_shape[-1])
    if loss is None and weights is not None:
        loss = (main.to(weights.dtype) * weights).sum()
    return loss, main


def _per_token(images: dict, inputs: dict) -> bool:
    """Whether an input beside the images has a value per text token (a cross-attention mask)."""
    tokens = inputs["input_ids"].shape[:2]
    return any(torch.is_tensor(v) and v.dim() > 2 and v.shape[:2] == tokens for v in images.values())


def _generate(model, inputs):
    """Greedy generate's token ids (of a generate that returns its own output object, DiffusionGemma's block
    diffusion: its sequences), from one seed: a generate that draws even when greedy (DiffusionGemma renoises its
    canvas) draws the same for the sharded model and its reference (the caller's RNG left as it was)."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        out = _generate_call(model, inputs)
    return getattr(out, "sequences", out)


def _generate_call(model, inputs):
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    ids = [getattr(c, k, None) for k in ("pad_token_id", "eos_token_id") for c in (config, text)]
    pad = next((v for v in ids if isinstance(v, int)), 0)
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": pad, "min_new_tokens": NEW_TOKENS}
    start = getattr(model.generation_config, "decoder_start_token_id", None)  # none in DiffusionGemma's own config
    if start is None and isinstance(getattr(text, "num_codebooks", None), int):
        # MusicGen's decoder starts each codebook's delay pattern from it (its checkpoints set it to bos), and its
        # own generate reads num_return_sequences without the default
        kwargs.update(decoder_start_token_id=text.bos_token_id, num_return_sequences=1)
    main = getattr(model, "main_input_name", "input_ids")
    main = main if main in inputs else next(iter(inputs))  # SpeechEncoderDecoder's "inputs": its encoder's
    codec = getattr(config, "codec_config", None)
    if isinstance(getattr(codec, "frame_size", None), int):  # Kyutai transcribes audio its codec encodes, a frame
        samples = (len(inputs["input_ids"]), 1, codec.frame_size * SEQ)
        audio = torch.randn(samples, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            return model.generate(input_values=audio, **kwargs)
    # audio or images into an encoder-decoder (PP-FormulaNet's input_ids feed its decoder): the decoder
    # generates from its start token
    if "input_ids" not in inputs or getattr(config, "is_encoder_decoder", False) and main != "input_ids":
        with torch.no_grad():
            return model.generate(**{main: inputs[main]}, **kwargs)
    images = {k: v for k, v in inputs.items() if k not in ("input_ids", "labels", "decoder_input_ids")}
    # image tokens then text, or text that cross-attends to the images with a mask per token (Idefics,
    # Mllama): all of it
    if "pixel_values" in images and (inputs["input_ids"].shape[1] > SEQ or _per_token(images, inputs)):
        prompt = inputs["input_ids"]
        kwargs.update(images)  # with what places the images (Qwen2-VL's grid and token types)
    else:
        prompt = inputs["input_ids"][:, : SEQ // 2]
        required = _required_by_generate(model)
        if required:  # BLIP's own generate: it takes pixel_values and sets its decoder's pad token itself
            kwargs.pop("pad_token_id")
            kwargs.update({k: images[k] for k in required if k in images})
    if "input_features" in inputs:  # Voxtral Realtime streams audio for every token, the generated ones too: all of it
        kwargs["input_features"] = inputs["input_features"]
    codes = inputs.get("decoder_input_ids")
    if codes is not None and codes.dim() == 3:  # Dia's decoder codes per channel: its audio prompt, their first half
        codes = codes[:, : SEQ // 2]
        kwargs.update(decoder_input_ids=codes, decoder_attention_mask=torch.ones(codes.shape[:2], dtype=torch.long))
    with torch.no_grad():
        return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **kwargs)


def _required_by_generate(model) -> list[str]:
    """The parameters a model's own ``generate`` requires (BLIP's captioner: ``pixel_values``), past the
    ``generate(*args, **kwargs)`` a sharded model's class may wrap it in."""
    for cls in type(model).__mro__:
        if "generate" not in vars(cls):
            continue
        params = list(inspect.signature(vars(cls)["generate"]).parameters.values())[1:]  # after self
        named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if named:
            return [p.name for p in named if p.default is p.empty]
    return []


def verify_on_this_rank(model: Any, policy: Any = None, model_class: str | None = None, seed: int = 0) -> VerifyReport:
    """The body each rank runs (torch.distributed must be up: its world is the tp group). Where a float32
    comparison fails, it is run again in float64: differences that shrink there by orders of magnitude
    are float32 rounding (summation order over ranks, amplified by the model), not the cut — a wrong cut
    differs as much in float64 — and the report says so with both numbers."""
    report = _compare(model, policy, model_class, seed, torch.float32, training=False)
    if _on_every_rank(report.error is not None and report.error.startswith(EVAL_BACKWARD)):
        trained = _compare(model, policy, model_class, seed, torch.float32, training=True)
        if trained.error is None or not trained.error.startswith(EVAL_BACKWARD):  # else eval mode's failure stands
            report = trained
    if _on_every_rank(report.error is None and not report.ok):  # every rank reruns, or none: it has collectives
        excuse_rounding(report, _compare(model, policy, model_class, seed, torch.float64, report.training))
    report.reference_after_step = None  # the report goes to rank 0 without its tensors
    return report


def _on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank, agreed by all."""
    flags = torch.tensor([flag], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags.item())


def checking_mode(model: torch.nn.Module, training: bool) -> None:
    """Eval mode (no dropout: both models compute the same function), or training mode with every dropout at 0
    for a model whose backward refuses eval mode (Reformer's reversible layers recompute activations only in
    training; its tiny copy's hashing is seeded: `shardformer.core.tiny_sequence`)."""
    if training:
        no_dropout(model)
    model.train(training)


def _outputs_after_step(out: torch.Tensor, ref_out: torch.Tensor) -> Check:
    """The outputs after the step, compared where the unsharded model's are finite; where a step at LR
    makes its own outputs overflow (a batch-normed ResNet's), the sharded ones must be non-finite at the
    same places."""
    finite = torch.isfinite(ref_out)
    if finite.all():
        err, ok = max_error(out, ref_out, GRAD_ATOL, GRAD_RTOL)
        return Check("outputs after step", ok, f"max |diff| {err:.2g}", err)
    same_places = out.shape == ref_out.shape and torch.equal(torch.isfinite(out), finite)
    err, ok = (
        max_error(out[finite], ref_out[finite], GRAD_ATOL, GRAD_RTOL) if same_places and finite.any() else (0.0, True)
    )
    detail = (
        f"max |diff| {err:.2g} where finite; the unsharded model's own outputs are not finite after the step at "
        f"{int((~finite).sum())} of {finite.numel()} places, the sharded ones "
        + ("at the same places" if same_places else "elsewhere")
    )
    return Check("outputs after step", ok and same_places, detail, err)


def _eager_experts(model) -> None:
    """transformers' grouped-matmul experts have no float64 kernel: the float64 rerun runs each expert's
    matmuls one by one ("eager", the same sums) in both copies."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"


def _compare(
    model: Any, policy: Any, model_class: str | None, seed: int, dtype: torch.dtype, training: bool
) -> VerifyReport:
    tp = dist.get_world_size()
    torch.manual_seed(seed)
    built = build_model(model, model_class).to(dtype)
    if dtype == torch.float64:
        _eager_experts(built)
    report = VerifyReport(type(built).__name__, "?", tp, training=training)
    broadcast_weights(built)
    checking_mode(built, training)
    ref = copy.deepcopy(built)
    try:
        pol = load_policy(policy)
        report.policy = type(pol).__name__ if pol is not None else "the first route proven exact"
        sharded = shard_model(built, ShardConfig(tensor_parallel_size=tp), pol)
        report.policy = route_name(sharded)
    except (ValueError, NotImplementedError, TypeError) as e:  # refused before any collective
        report.error = f"sharding refused: {e}"
        return report
    group = dist.group.WORLD
    inputs = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in inputs_for(ref, seed + 1).items()}  # fmt: skip

    step = "forward"
    # float64: no float32 step left in the run, not even where the model asks for one (built and cut as usual)
    precise = Float64Everywhere() if dtype == torch.float64 else contextlib.nullcontext()
    try:
        with precise:
            rec_ref, rec_sh = ActivationRecorder(ref), ActivationRecorder(sharded)
            ref_loss, ref_out = _loss_and_output(ref, inputs, None, None, None)
            weights = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
            if ref_loss is None:  # no loss of its own: a fixed random projection of the output
                ref_loss = (ref_out.to(dtype) * weights).sum()
            loss, out = _loss_and_output(sharded, inputs, weights, group, ref_out.shape)
            rec_ref.remove(), rec_sh.remove()
            err, ok = max_error(out, ref_out, ATOL, RTOL)
            detail = f"max |diff| {err:.2g} (output {list(ref_out.shape)})"
            report.checks.append(Check("forward outputs", ok, detail, err))
            report.divergence = first_divergence(rec_ref, rec_sh, group)
            err, ok = max_error(loss, ref_loss, ATOL, RTOL)
            report.checks.append(
                Check("loss", ok, f"{loss.item():.6g} vs {ref_loss.item():.6g} (|diff| {err:.2g})", err)
            )

            step = EVAL_BACKWARD if not training else "backward of the unsharded model"
            ref_loss.backward()
            step = "backward"
            loss.backward()
            report.checks.append(params_check("gradients", compare_params(ref, sharded, group, grads=True), True))

            step = "optimizer step"
            for m in (ref, sharded):
                torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LR).step()
            after_step = compare_params(ref, sharded, group, grads=False)
            report.checks.append(params_check("weights after step", after_step, False))
            with torch.no_grad():
                _, ref_out = _loss_and_output(ref, inputs, weights, None, None)
                _, out = _loss_and_output(sharded, inputs, weights, group, ref_out.shape)
            # from weights that agree within the step's tolerance, so held to that tolerance
            report.checks.append(_outputs_after_step(out, ref_out))
            report.reference_after_step = ref_out.detach()

            step = "generate"
            if callable(getattr(ref, "can_generate", None)) and ref.can_generate():
                ref.eval(), sharded.eval()  # generating is inference (Reformer's cache refuses training mode)
                expected, got = _generate(ref, inputs), _generate(sharded, inputs)
                same = got.shape == expected.shape and torch.equal(got, expected)
                detail = f"{BATCH} x {NEW_TOKENS} new tokens " + (
                    "equal" if same else f"differ: {got[:, SEQ // 2 :].tolist()} vs {expected[:, SEQ // 2 :].tolist()}"
                )
                report.checks.append(Check("greedy generate", same, detail))
    except Exception as e:  # noqa: BLE001 - reported, with the module that diverged if one did
        report.error = f"{step} failed: {type(e).__name__}: {e}"
    return report


def verify(
    model: Any,
    policy: Any = None,
    tp: int = 2,
    pp: int = 1,
    *,
    pipeline: Any = None,
    model_class: str | None = None,
    seed: int = 0,
    timeout: float = 300.0,
) -> VerifyReport:
    """Compare ``model`` sharded at ``tp`` (and split into ``pp`` pipeline stages) with itself unsharded,
    on ``tp * pp`` local gloo processes.

    ``model``: a factory (a module-level function, so spawned processes can import it), a folder
    with config.json, ``module:function``, ``timm:<name>`` or a built-in name (`TINY_MODELS`).
    ``policy``: a Policy (instance or class, importable) or ``module:Class``; default: the built-in one.
    ``pipeline``: a PipelineSpec for ``pp > 1`` (default: the family's built-in one). With ``pp > 1`` the training engine runs one step (loss, weights, outputs after it); module-by-module
    divergence and generate are checked at ``pp=1``; greedy generate gets what the class's own generate reads
    beside a prompt (MusicGen's decoder start token, Dia's audio-code prompt, Kyutai's audio). Returns a
    `VerifyReport` (``.ok``, ``.format()``, ``.divergence``).
    """
    check_positive_int("tp", tp)
    check_positive_int("pp", pp)
    if tp * pp < 2:
        raise ValueError("tp * pp must be at least 2: one process has nothing to compare")
    check_model_source(model, model_class)  # a wrong name or path: one error here, no processes started
    if pp == 1:
        reports = run_on_ranks(verify_on_this_rank, tp, model, policy, model_class, seed, timeout=timeout)
    else:
        reports = run_on_ranks(
            verify_pipeline_on_this_rank, tp * pp, model, policy, model_class, seed, pp, pipeline, timeout=timeout
        )
    return merge_reports(reports)
