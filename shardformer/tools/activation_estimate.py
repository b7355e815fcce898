"""Activation memory per rank of one training forward, estimated from the model's config.

What is estimated: the bytes a training forward ``loss = model(input_ids, labels=...).loss`` leaves
alive for the backward on one tensor-parallel rank: the tensors autograd saved. The returned logits
and KV cache (transformers builds one in training too unless ``use_cache=False``) are not counted:
the step drops them, except where the attention keeps the cache's copies of k and v itself. Units
below: b batch, s sequence, h hidden, a heads, k key/value heads, d = h / a, i intermediate size, v vocabulary
(padded to a multiple of tp), t tp, w bytes per activation element, m bytes per dropout mask
element: torch's dropout keeps a float noise tensor on CPU (m = w) and a bool mask on CUDA (m = 1);
shardformer's seeded dropout layers, which replace a sharded model's ``nn.Dropout`` modules, keep a
bool mask (m = 1) on any device; dropout of attention probabilities (functional, in transformers'
attention functions) stays torch's.

Per transformer layer (what each op saves, read from transformers 5.23 and torch 2.14; checked in
fp32 against the bytes a real forward saves, tests/test_plan.py; half precision is not checked):

======================  ==========================================================================
kind                    elements saved (x w unless marked)
======================  ==========================================================================
LayerNorm (GPT-2)       its input (bsh)
RMSNorm (Llama)         its input upcast to fp32 (bsh x 4 bytes) and its normalised input (bsh)
column-layer inputs     the norm's output read by q/k/v (or c_attn) and by the MLP's first linear(s)
                        (2 bsh)
residual dropout        a mask after attention and after the MLP (2 bsh x m), if resid_pdrop > 0
attention, eager        q, k, v as the matmuls read them (3 bsh; Llama with k < a: q + 2 bsh of
                        repeated k/v); softmax output (b a s^2; Llama's in fp32, + its cast back in
                        half precision), with attention dropout also torch's mask and the dropped
                        probabilities
attention, sdpa         fused kernel: q, k, v (GPT-2: views of c_attn's output, 3 bsh, + 2 bsh of
                        cache copies when the cache is on; Llama: q + 2 bskd) and a logsumexp
                        (b a s, fp32). With attention dropout torch runs sdpa's math path: as eager
attention output        the merged heads read by the output projection (bsh)
MLP, GPT-2              gelu_new saves 4 tensors of bsi (x, x/2, tanh, 1 + tanh), F.gelu 1; the
                        second linear's input (bsi)
MLP, Llama (gated)      gate output, silu(gate), up output, their product (4 bsi)
======================  ==========================================================================

Outside the layers: the embedding dropout mask (bsh x m), the final norm (as above) and the head's
input (bsh); the loss's fp32 softmax or log-softmax (bsv / t x 4 bytes; the logits themselves are
not kept).

Under tensor parallelism the attention and MLP interiors (q/k/v, scores, attention output, MLP
activations) and the logits are split by t; norms, column-layer inputs, residual dropout and the
embedding stay whole on every rank. With Megatron sequence parallelism the norms and residual
dropout masks are split by t too, and so are the column-layer inputs: each block all-gathers its
input, and its first linears keep only this rank's chunk of it for the backward, which all-gathers
it again (``sequence_parallel_regather``, the default); with ``sequence_parallel_regather=False``
they keep the gathered tensor (whole). The final norm runs on the chunk too (the region ends after
it), and the LM head keeps only this rank's chunk of its input, which it re-gathers in backward
(whole with ``sequence_parallel_regather=False``). Embeddings run as in plain tp.
With activation checkpointing a layer keeps only its input (bsh, / t under sequence parallelism)
and transformers turns the cache off; one layer's activations come back during the backward
(``recompute``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GPT2_LIKE = ("gpt2",)
LLAMA_LIKE = ("llama", "mistral", "qwen2")
GELU_SAVES = {"gelu_new": 4, "gelu_pytorch_tanh": 1, "gelu": 1}


@dataclass
class ActivationEstimate:
    """Bytes per rank, by part; ``recompute`` is what one layer adds back during a checkpointed backward."""

    parts: dict[str, int] = field(default_factory=dict)
    layer_whole: int = 0  # bytes of one layer that tp does not split
    layer_split: int = 0  # bytes of one layer that tp splits
    recompute: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _heads(config) -> tuple[int, int, int, int]:
    h = config.hidden_size
    a = config.num_attention_heads
    k = getattr(config, "num_key_value_heads", None) or a
    return h, a, k, getattr(config, "head_dim", None) or h // a


def estimate_activations(
    config,
    batch: int,
    seq: int,
    tp: int = 1,
    *,
    dtype_bytes: int = 4,
    sequence_parallel: bool = False,
    sequence_parallel_regather: bool = True,
    checkpointing: bool = False,
    device: str = "cpu",
    use_cache: bool | None = None,
    sharded: bool | None = None,
) -> ActivationEstimate:
    """Estimate activation bytes per tensor-parallel rank (see the module docstring for the formula).

    ``sharded``: the model went through ``shard_model`` (its dropout modules keep bool masks);
    default: ``tp > 1``. ``use_cache``: default the config's, as transformers does.
    ``sequence_parallel_regather``: as ShardConfig's (only read with ``sequence_parallel``)."""
    kind = config.model_type
    if kind not in GPT2_LIKE + LLAMA_LIKE:
        raise NotImplementedError(
            f"no activation estimate for model_type={kind!r}; it is derived for {', '.join(GPT2_LIKE + LLAMA_LIKE)}"
        )
    for name, value in (("batch", batch), ("seq", seq), ("tp", tp)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} must be 'cpu' or 'cuda' (it sets the size of dropout masks)")
    w, torch_mask = dtype_bytes, (dtype_bytes if device == "cpu" else 1)
    m = 1 if (tp > 1 if sharded is None else sharded) else torch_mask  # mask bytes of nn.Dropout modules
    cache = not checkpointing and (config.use_cache if use_cache is None else use_cache)
    h, a, k, d = _heads(config)
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    bs, t = batch * seq, tp
    vocab = -(-config.vocab_size // t) * t

    if kind in GPT2_LIKE:
        i = config.n_inner or 4 * h
        resid, attn_p, embd = config.resid_pdrop, config.attn_pdrop, config.embd_pdrop
        norms = 2 * bs * h * w  # LayerNorm inputs
        drop = 2 * bs * h * m if resid > 0 else 0
        if impl == "sdpa" and attn_p == 0:
            attn = 3 * bs * h * w + (2 * bs * h * w if cache else 0) + batch * a * seq * 4
        else:  # eager, or sdpa's math path (dropout): torch's dropout on the probabilities
            attn = 3 * bs * h * w + _probs(batch, a, seq, w, torch_mask, attn_p)
        mlp = (GELU_SAVES.get(config.activation_function, 1) + 1) * bs * i * w
        final_norm, embd_drop = bs * h * w, (bs * h * m if embd > 0 else 0)
    else:
        i = config.intermediate_size
        attn_p = getattr(config, "attention_dropout", 0.0)
        norms, drop = 2 * bs * h * (4 + w), 0  # RMSNorm keeps its input upcast to fp32
        q, kv = bs * a * d * w, 2 * bs * k * d * w
        if impl == "sdpa" and attn_p == 0:
            attn = q + kv + batch * a * seq * 4
        else:
            repeated = 2 * bs * a * d * w if k < a else kv
            probs = _probs(batch, a, seq, w, torch_mask, attn_p, softmax_bytes=4)  # Llama's softmax runs in fp32
            attn = q + repeated + probs
        mlp = 4 * bs * i * w
        final_norm, embd_drop = bs * h * (4 + w), 0

    entry_inputs = 2 * bs * h * w  # the norm outputs the column layers keep (gathered, or a chunk re-gathered)
    split = (attn + bs * h * w + mlp) // t  # + the attention output the row layer keeps
    chunked = sequence_parallel and sequence_parallel_regather
    whole = entry_inputs // (t if chunked else 1) + (norms + drop) // (t if sequence_parallel else 1)
    layers = config.num_hidden_layers
    est = ActivationEstimate(layer_whole=whole, layer_split=split)
    if checkpointing:
        est.parts["layer inputs (checkpointed)"] = layers * bs * h * w // (t if sequence_parallel else 1)
        est.recompute = whole + split
    else:
        est.parts["layers, whole on every rank"] = layers * whole
        est.parts["layers, split over tp"] = layers * split
    est.parts["embedding dropout"] = embd_drop
    est.parts["final norm + head input"] = final_norm // (t if sequence_parallel else 1) + bs * h * w // (
        t if chunked else 1
    )
    est.parts["loss softmax"] = bs * vocab // t * 4
    return est


def _probs(batch: int, heads: int, seq: int, w: int, m: int, dropout: float, softmax_bytes: int | None = None) -> int:
    """Attention probabilities kept by the eager / math path: the softmax output (in fp32 where the model
    upcasts it, then also its cast back), with dropout its mask and the dropped probabilities (which
    the value matmul keeps)."""
    scores = batch * heads * seq * seq
    softmax = w if softmax_bytes in (None, w) else softmax_bytes + w
    return scores * softmax if dropout == 0 else scores * (softmax + m + w)
