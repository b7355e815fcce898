"""The transformers zoo as sweep rows: which classes each task sweeps, and each class's tiny copy.

A row is ``{task, model_type, class, kind}`` (kind: "dense" or "moe"). Its tiny copy is the class's default
config scaled down for tp=2 (``shardformer.core.tiny_run``: the recipe's first scaling whose model runs);
:func:`check_unsharded`, the sweeps' precheck, marks a row "not tested" when no tiny copy of its class runs
unsharded (a limit of the recipe, not a refusal of the library: counted apart from refusals).
"""

from __future__ import annotations

import json

from sweeps.rows import NOT_TESTED, NotTested, set_reason

MOE_STYLES = ("moe_", "grouped_gemm", "ep_")

# task: the auto mapping of transformers' modeling_auto it sweeps, in the order of the tables
TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "base-model": "MODEL_MAPPING_NAMES",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}
# base models only of the encoders: model types that also have a masked-LM, an image-classification or
# a two-tower (zero-shot image classification) class
ENCODER_MAPPINGS = (
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
)


# -- which classes ------------------------------------------------------------------------------------


def _mapping(name: str) -> dict[str, tuple[str, ...]]:
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, name, {})
    return {k: (v,) if isinstance(v, str) else tuple(v) for k, v in names.items()}


def _kind(config_class) -> str:
    """ "moe" or "dense": from the tp plan's styles, else from the default config's expert count (a plan
    may name only the embedding, as GPT-OSS's does)."""
    plan = getattr(config_class, "base_model_tp_plan", None) or {}
    if any(style.startswith(MOE_STYLES) for style in plan.values()):
        return "moe"
    from shardformer.expert_parallel.find import declared_count

    try:
        return "moe" if declared_count(config_class()) else "dense"
    except Exception:  # noqa: BLE001 - reported when the row runs
        return "dense"


def task_rows(tasks=None, only=None) -> list[dict]:
    """``[{task, model_type, class, kind}]`` of the installed transformers, each class once (under the
    first selected task that names it); a class that cannot be imported carries ``skip`` (the reason)."""
    import transformers as tf

    encoders = set().union(*(_mapping(m) for m in ENCODER_MAPPINGS))
    rows, seen = [], set()
    for task, mapping in TASKS.items():
        if tasks and task not in tasks:
            continue
        for model_type, class_names in _mapping(mapping).items():
            if task == "base-model" and model_type not in encoders:
                continue
            for class_name in class_names:
                if class_name in seen or (only and model_type not in only and class_name not in only):
                    continue
                seen.add(class_name)
                row = {"task": task, "model_type": model_type, "class": class_name, "kind": ""}
                try:
                    row["kind"] = _kind(getattr(tf, class_name).config_class)
                except Exception as e:  # noqa: BLE001 - a missing optional backend: reported as not tested
                    row["skip"] = f"class not importable: {type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
    return rows


def architectures(only=None) -> list[dict]:
    """The plan sweep's rows: every causal LM whose config has a ``base_model_tp_plan``."""
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    for model_type, lm_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if only and model_type not in only:
            continue
        try:
            config_class = getattr(tf, lm_name).config_class  # the text config of a multimodal family
        except (AttributeError, ImportError, TypeError):
            continue
        plan = getattr(config_class, "base_model_tp_plan", None)
        if not plan:
            continue
        rows.append(
            {
                "task": "causal-lm",
                "model_type": model_type,
                "class": lm_name,
                "kind": _kind(config_class),
                "route": "TpPlanPolicy",
            }  # fmt: skip
        )
    return rows


def add_filters(parser, task: str = "") -> None:
    """The options that choose a sweep's classes (``--task``, ``--only``, ``--dense``, ``--limit``)."""
    parser.add_argument(
        "--task", default=task, help=f"comma-separated tasks (default: {task or 'all'}): {','.join(TASKS)}"
    )
    parser.add_argument("--only", default="", help="comma-separated model types or class names (default: all)")
    parser.add_argument("--dense", action="store_true", help="dense classes only")
    parser.add_argument("--limit", type=int, default=0, help="at most this many classes (after the filters)")


def chosen_rows(args, parser, rows_of=task_rows, keep=None) -> list[dict]:
    """The rows :func:`add_filters`' options choose: ``rows_of(tasks, only)``, those ``keep(row)`` keeps,
    dense ones only with ``--dense``, then the first ``--limit``."""
    tasks = set(filter(None, args.task.split(",")))
    if unknown := tasks - set(TASKS):
        parser.error(f"unknown task(s) {', '.join(sorted(unknown))}; known: {', '.join(TASKS)}")
    rows = rows_of(tasks, set(filter(None, args.only.split(","))))
    rows = [r for r in rows if (keep is None or keep(r)) and (not args.dense or r["kind"] == "dense")]
    return rows[: args.limit] if args.limit else rows


def newest_verify_sweep(folder: str) -> str:
    """The newest saved verify sweep in ``folder`` (``conformance-<date>.json``)."""
    import glob
    import os

    found = sorted(glob.glob(os.path.join(folder, "conformance-[0-9]*.json")))
    if not found:
        raise SystemExit(f"no verify sweep (conformance-<date>.json) in {folder}")
    return found[-1]


def per_task(rows: list[dict], n: int, sweep_path: str, also: frozenset = frozenset()) -> list[dict]:
    """A stratified sample of ``rows``: the first ``n`` classes of each task that passed at tp=2 in the saved
    verify sweep ``sweep_path`` (classes that shard exactly, so that a row tests the technique, not the cut),
    and the classes named in ``also``."""
    with open(sweep_path) as f:
        passed = {r["class"] for r in json.load(f)["rows"] if r["result"] == "passed"}
    taken: dict[str, set] = {}  # task -> its classes sampled (a class has a row per technique in the engine sweep)
    sample = []
    for row in rows:
        classes = taken.setdefault(row["task"], set())
        if row["class"] in passed and (row["class"] in classes or len(classes) < n):
            classes.add(row["class"])
            sample.append(row)
        elif row["class"] in also:
            sample.append(row)
    return sample


# -- each class's tiny copy -----------------------------------------------------------------------------


def tiny_config_of(class_name: str):
    """The class's default config scaled down for tp=2: the recipe's first scaling whose model runs
    (``shardformer.core.tiny_run``); ``TinyCopyError`` when none does."""
    import transformers as tf

    from shardformer.core.tiny import VOCAB
    from shardformer.core.tiny_run import runnable_tiny_config
    from shardformer.models import inputs_for

    model_class = getattr(tf, class_name)
    config = default_config(class_name)
    for key in ("image_token_index", "video_token_index"):  # BLIP-2's, InstructBLIP-Video's
        if hasattr(config, "num_query_tokens") and getattr(config, key, 0) is None:
            setattr(config, key, VOCAB + 1)  # their checkpoints set one; their default config (None) cannot run
    return runnable_tiny_config(model_class, config, 2, inputs=inputs_for)


QSA = {"n_heads": 16, "kv_heads": 1, "head_dim": 128, "budget": 2048, "compress_ratio": 4}
# values a class's checkpoints set where its default config, shared with the family's other heads, does not
# build that class (a user's config, read from a checkpoint, has them)
AS_CHECKPOINTS_SET = {
    # Fourier features (261 channels) and a convolution's (322) over one cross-attention head, not 8
    "PerceiverForImageClassificationFourier": {"num_cross_attention_heads": 1},
    "PerceiverForImageClassificationConvProcessing": {"num_cross_attention_heads": 1},
    "ReformerModelWithLMHead": {"is_decoder": True},  # its __init__ asserts it
    # generate's multimodal rotary reads vision_start_token_id, which the thinker's config class does not
    # declare (its checkpoints' thinker configs set it)
    **{
        n: {"vision_start_token_id": 151652}
        for n in ("Qwen2_5OmniThinkerForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration")
    },
    # DBRX's attention reads attn_config.rope_theta, a field its sub-config class does not declare, and
    # clamps by clip_qkv, None by default (5.24); its checkpoints set both
    **{n: {"attn_config.rope_theta": 500000.0, "attn_config.clip_qkv": 8.0} for n in ("DbrxForCausalLM", "DbrxModel")},
    # Llama 4's default vision tower is 768 wide with a 7680-wide output, its adapter sized for the checkpoints'
    # 1408 (4 x 1408 after the pixel shuffle) and their 4096-wide output:
    # the default config runs no image
    "Llama4ForConditionalGeneration": {"vision_config.hidden_size": 1408, "vision_config.vision_output_dim": 4096},
    # Janus's default vision projection (2048) is not its default text width (4096): the default config places no
    # image; its 7B checkpoint projects to its text's 4096
    "JanusForConditionalGeneration": {"vision_config.projection_dim": 4096},
    # its default config has no image token (None) and places no image; its checkpoints set one past the text's
    # vocabulary (the copy maps it to one of its own ids)
    "NemotronH_Omni_Reasoning_V3": {"image_token_id": 131072},
    # their rotaries split each head by the checkpoints' mrope_section, which the code defaults to when the
    # config names none; a tiny head must have it scaled, so it is written down as the checkpoints write it
    "PaddleOCRVLForConditionalGeneration": {
        "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [16, 24, 24]}
    },
    "Ernie4_5_VLMoeForConditionalGeneration": {
        "text_config.rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [22, 22, 20]}
    },
    # Qwen4-Exp builds its QSA indexer on every indexed-attention layer, and its default config leaves the
    # indexer's five fields None: set as its validator requires (one key head, a budget the compression ratio
    # divides), widths as the model's own (its query heads, its linear-attention head width); not a checkpoint's
    **{
        n: {f"{prefix}indexer_{k}": v for k, v in QSA.items()}
        for n, prefix in (("Qwen4ExpForCausalLM", ""), ("Qwen4ExpForConditionalGeneration", "text_config."))
    },
}


def _chameleon_code(code: int) -> str:  # its tokenizer spells a VQ code's digits as letters: 105 -> IMGIMGBAFZ
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


# Chameleon's and Emu3's image tokens: the checkpoints' configs copy their tokenizer's map of names to ids (one
# name per VQ code, and the names the model looks up); the default configs have none and build no model
AS_CHECKPOINTS_SET["ChameleonForConditionalGeneration"] = {
    "vocabulary_map": {"<image>": 8711, **{_chameleon_code(c): 4 + c for c in range(8192)}},
    "image_token_id": 8711,  # what the config reads from the map when a checkpoint is loaded
}
AS_CHECKPOINTS_SET["Emu3ForConditionalGeneration"] = {
    "vocabulary_map": {
        "<image>": 184621,
        "<|extra_200|>": 151846,  # the end of a row of image tokens
        **{f"<|visual token{c:06d}|>": 151854 + c for c in range(32768)},
    },
    "image_token_id": 184621,
}


# Granite 4 Vision's default config leaves its deepstack (which vision layer feeds which text layer) and its
# Q-Former's downsampling unset; its checkpoints (granite-vision-4.1) set them
AS_CHECKPOINTS_SET["Granite4VisionForConditionalGeneration"] = {
    "deepstack_layer_map": [[-19, 9], [-13, 6], [-7, 3], [-1, 0]],
    "downsample_rate": "4/8",
}


# Perception LM's default vision tower is timm's default (a ResNet-50, no model_args), which its projector cannot
# read; its checkpoints (Perception-LM-1B, 3B) run PE-Core-L at 448 pixels, its arguments in model_args
AS_CHECKPOINTS_SET["PerceptionLMForConditionalGeneration"] = {
    "vision_config.architecture": "vit_pe_core_large_patch14_336",
    "vision_config.model_args": {
        "embed_dim": 1024,
        "depth": 23,
        "img_size": [448, 448],
        "global_pool": "",
        "use_post_transformer_norm": False,
        "init_values": 0.1,
        "ref_feat_shape": [32, 32],
    },
    "vision_config.do_pooling": False,
    "projector_pooling_ratio": 2,
}


# DeepSeek-OCR 2's SAM neck ends in 896 channels that it concatenates with queries of its encoder's width, 4096 in
# the default config (which therefore runs no image); its checkpoint's encoder is Qwen2-0.5B's, 896 wide
AS_CHECKPOINTS_SET["DeepseekOcr2ForConditionalGeneration"] = {
    "vision_config.encoder_config.hidden_size": 896,
    "vision_config.encoder_config.intermediate_size": 4864,
    "vision_config.encoder_config.num_attention_heads": 14,
    "vision_config.encoder_config.num_key_value_heads": 2,
}


GEMMA4_ASSISTANT_TEXT = ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block")
# Gemma 4 Assistant's validator refuses its own default text config (Gemma 4's, with per-layer inputs, MoE blocks,
# double-wide MLPs); its checkpoints' text configs have none of them
AS_CHECKPOINTS_SET["Gemma4AssistantForCausalLM"] = {
    **{f"text_config.{k}": 0 for k in GEMMA4_ASSISTANT_TEXT[:2]},
    **{f"text_config.{k}": False for k in (GEMMA4_ASSISTANT_TEXT[2], "use_double_wide_mlp")},
}


# class -> the generation settings its checkpoints' generation_config.json sets, from the model's config, where its
# generate cannot run without them
GENERATION_AS_CHECKPOINTS = {
    # Pop2Piano's generate prepends a composer's embedding, read through this map (one entry per embedding)
    "Pop2PianoForConditionalGeneration": lambda config: {
        "composer_to_feature_token": {f"composer{i + 1}": i for i in range(config.composer_vocab_size)}
    },
}


def set_as_checkpoints(config, class_name: str) -> None:
    """Set the class's `AS_CHECKPOINTS_SET` values on ``config``; a dotted key names a sub-config's field."""
    for key, value in AS_CHECKPOINTS_SET.get(class_name, {}).items():
        *path, field = key.split(".")
        owner = config
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, field, value)


def _nested(values: dict) -> dict:
    """Dotted keys (``text_config.vocab_size``) as nested dicts, a config's constructor arguments."""
    nested: dict = {}
    for key, value in values.items():
        *path, field = key.split(".")
        owner = nested
        for part in path:
            owner = owner.setdefault(part, {})
        owner[field] = value
    return nested


def default_config(class_name: str):
    """The class's default config as its checkpoints' would be: with its `AS_CHECKPOINTS_SET` values and, where
    it builds no model (on the meta device), what it leaves unset filled (`shardformer.core.tiny_defaults`)."""
    import transformers as tf

    from shardformer.core.tiny_defaults import complete_unset

    model_class = getattr(tf, class_name)
    try:
        config = model_class.config_class()
    except Exception:  # noqa: BLE001 - a default its own validator refuses (Gemma 4 Assistant's): the values given
        config = model_class.config_class(**_nested(AS_CHECKPOINTS_SET.get(class_name, {})))
    set_as_checkpoints(config, class_name)
    if _meta_build_failure(model_class, config) is not None:
        complete_unset(config)
    return config


def _meta_build_failure(model_class, config) -> str | None:
    import torch

    try:
        with torch.device("meta"):
            model_class(config)
    except Exception as e:  # noqa: BLE001 - the reason a row names
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None


class TinyBuildError(NotTested):
    """The tiny model could not be constructed from its config (the same on every rank)."""


def build_tiny(class_name: str, flip: dict | None = None):
    """The class's tiny model (module-level: ``functools.partial(build_tiny, name)`` pickles); ``flip``:
    config values set on the tiny config before the model is built (``sweeps/config_flips.py``)."""
    return _build(class_name, tiny_config_of(class_name), flip)


def _build(class_name: str, config, flip: dict | None):
    import transformers as tf

    from shardformer.core.tiny import fill_zero_matrices
    from shardformer.core.tiny_norms import batch_norms, settle_batch_norms
    from shardformer.models import inputs_for

    for key, value in (flip or {}).items():  # on the config that holds the key (a text config's, else the top)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        setattr(text if key in text.to_dict() else config, key, value)
    try:
        model = getattr(tf, class_name)(config)
    except Exception as e:  # noqa: BLE001
        raise TinyBuildError(f"a tiny {class_name} cannot be built from this config: {type(e).__name__}: {e}") from e
    fill_zero_matrices(model)
    if batch_norms(model):  # as a trained model's: random layers would shrink everything to 0 in eval mode;
        # on the inputs the checks run (verify's seed 1): a random copy's near-constant channels, normalised by
        # statistics of other inputs, would blow up in eval mode (LeViT's logits at 1e3)
        settle_batch_norms(model, inputs_for(model, 1))
    for key, value in GENERATION_AS_CHECKPOINTS.get(class_name, lambda _: {})(config).items():
        setattr(model.generation_config, key, value)
    return model


def unsharded_failure(class_name: str, flip: dict | None = None, generate: bool = True) -> tuple[str, str] | None:
    """``(step, error)`` of the first step that fails for the tiny model unsharded (config, build, inputs,
    forward, backward, generate: as verify runs them), or None when it runs."""
    try:
        config = tiny_config_of(class_name)
    except Exception as e:  # noqa: BLE001 - what the row reports
        return "config", f"{type(e).__name__}: {e}"
    failure = _forward_backward(class_name, config, flip, training=False, generate=generate)
    if failure is not None and failure[0] == "backward":  # verify's rule: checked again in training mode
        trained = _forward_backward(class_name, config, flip, training=True, generate=generate)
        failure = failure if trained is not None and trained[0] == "backward" else trained
    return failure


def _forward_backward(class_name: str, config, flip: dict | None, training: bool, generate: bool):
    """``(step, error)`` of the first step of verify's that fails for the tiny model, built from ``config``
    (in training mode with dropout 0 when ``training``), or None."""
    import torch

    from shardformer.models import inputs_for
    from shardformer.tools.verify import _generate, _loss_and_output, checking_mode

    step = "build"
    try:
        torch.manual_seed(0)
        model = _build(class_name, config, flip)
        checking_mode(model, training)
        step = "inputs"
        inputs = inputs_for(model, 1)
        step = "forward"
        loss, out = _loss_and_output(model, inputs, None, None, None)
        if torch.is_tensor(out) and not torch.isfinite(out).all():  # nothing to compare a sharded copy with
            bad = (~torch.isfinite(out)).sum().item()
            raise FloatingPointError(f"{bad} of its {out.numel()} outputs are not finite (unsharded, before any step)")
        if torch.is_tensor(out) and out.is_floating_point() and not out.abs().max() > 0:  # any cut would "agree"
            raise FloatingPointError(
                "its outputs are all zero (unsharded, before any step): its random layers shrink them"
            )
        step = "backward"
        (loss if loss is not None else out.float().sum()).backward()
        if generate and callable(getattr(model, "can_generate", None)) and model.can_generate():
            step = "generate"
            _generate(model.eval(), inputs)
    except Exception as e:  # noqa: BLE001 - what the row reports
        return step, f"{type(e).__name__}: {e}"
    return None


def tiny_config_class(class_name: str) -> str:
    import transformers as tf

    return getattr(tf, class_name).config_class.__name__


def default_build_failure(class_name: str) -> str | None:
    """Why the class built from its `default_config` (on the meta device: no memory) fails, or None when it
    builds: a tiny copy of that config cannot do better."""
    import transformers as tf

    try:
        config = default_config(class_name)
    except Exception as e:  # noqa: BLE001 - the reason the row names
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return _meta_build_failure(getattr(tf, class_name), config)


# model type -> (a fragment of the error, why): the model's own code failing on the tiny copy, not the recipe
# (each shown by a test in tests/test_sweep_rows.py)
UPSTREAM_FAILURES = {
    "xlstm": (
        "matC_old has wrong shape",
        "xLSTM's cache sizes its state by qk_dim rounded up to a multiple of 64 (xLSTMConfig.qk_dim), its layers "
        "by hidden_size * qk_dim_factor unrounded: any width where the two differ fails in eval mode",
    ),
    "blt": (
        "no attribute 'num_hidden_layers'",
        "BltConfig has no num_hidden_layers, which the cache built in eval mode reads: its default config fails alike",
    ),
    "llama4": (
        "no attribute 'image_outputs'",
        "Llama4ForConditionalGeneration.forward reads image_outputs from its language model's output, which has none",
    ),
    **{
        model_type: (
            "inputs_embeds and shared_kv_states cannot be None",
            f"{name} is a drafter: its forward requires the keys and values its target model shares "
            "(shared_kv_states) with the target's inputs_embeds, so it runs only inside the target's generate "
            "(assistant_model=...), never on its own (nor does its generate)",
        )
        for model_type, name in (
            ("gemma4_unified_assistant", "Gemma 4's unified assistant"),
            ("gemma4_assistant", "Gemma 4's assistant"),
        )
    },
    "vibevoice": (
        "requires `diffusers`",
        "VibeVoice's generate samples its audio latents with a diffusers noise scheduler (DPMSolverMultistepScheduler), "
        "and diffusers is not among shardformer's dependencies (installable from PyPI; not installed here)",
    ),
}


def upstream_failure(class_name: str, error: str) -> str | None:
    """Why ``error`` (the tiny copy's failure) is the class's own code's, from `UPSTREAM_FAILURES`, or None."""
    import transformers as tf

    fragment, why = UPSTREAM_FAILURES.get(getattr(tf, class_name).config_class.model_type, (None, None))
    return why if fragment is not None and fragment in error else None


_UNSHARDED: dict[tuple[str, str], dict] = {}  # (class, flip) -> what check_unsharded found (rows per technique)


def check_unsharded(row: dict) -> None:
    """The precheck of the zoo's sweeps: ``row`` not tested when no tiny copy of its class (with the row's
    ``flip``) runs unsharded."""
    name, flip = row["class"], row.get("flip")
    key = (name, json.dumps(flip, sort_keys=True))
    if key not in _UNSHARDED:
        found: dict = {}
        failure = unsharded_failure(name, flip)  # the tiny model itself: nothing to shard
        upstream = default_build_failure(name) if failure is not None and failure[0] == "config" else None
        known = upstream_failure(name, failure[1]) if failure is not None else None
        if upstream is not None:  # not the recipe's doing: the class's own default config builds no model
            set_reason(found, NOT_TESTED, f"upstream: {name}({tiny_config_class(name)}()) does not build: {upstream}")
        elif known is not None:
            set_reason(found, NOT_TESTED, f"upstream: {known}; the tiny model fails in {failure[0]}: {failure[1]}")
        elif failure is not None and failure[0] == "config":  # a config we cannot scale down
            set_reason(found, NOT_TESTED, f"no tiny copy that runs: {failure[1]}")
        elif failure is not None:
            set_reason(found, NOT_TESTED, f"the tiny unsharded model fails in {failure[0]}: {failure[1]}")
        _UNSHARDED[key] = found
    row.update(_UNSHARDED[key])
