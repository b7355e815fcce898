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

Under context parallelism (cp = c) each rank holds n = 2 * ceil(s / 2c) tokens (the load-balanced
split, `shardformer.context_parallel.layout`), so every per-token term above counts n tokens
instead of s (tensor and sequence parallelism then split them as above) and the cache is off. The
attention differs by mode (checked in fp32 against a real forward at cp=2, tests/test_plan.py):

- ring: whatever the model's implementation, the ring keeps q, k, v, its output and a log-sum-exp
  (b a n, fp32). Its output is fp32 and laid out like q ([b, n, a, d] in memory): in fp32 it is the
  output projection's input (already counted), in half precision one more b n h x 4 bytes. Its
  block masks (b n^2 bools per rank) are shared by the forward's layers and dropped at its end
  (backward evaluates them again). Attention dropout is refused (as the library does).
- all_to_all: the model's own attention on a / c heads over the whole (padded) sequence S = c n:
  q, k, v as above but head-split (the same bytes; k/v repeated to a heads first when k does not
  divide by c); sdpa also keeps its output (b n h, it no longer is the output projection's input);
  eager keeps b (a / c) S^2 probabilities, i.e. b a n S. Assumed: no padding mask and a length 2c
  divides; otherwise sdpa gets a mask and takes a path that keeps more (+4% measured at hidden 128).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardformer.core.config import CP_MODES

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
    per_layer: int = 0  # bytes one layer keeps (its input alone when checkpointed)
    first: int = 0  # bytes kept before the layers (the first pipeline stage's)
    last: int = 0  # bytes kept after the layers: final norm, head input, loss (the last stage's)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def stage(self, layers: int, first: bool, last: bool, in_flight: int = 1) -> int:
        """Bytes of a pipeline stage holding ``layers`` layers (and the model's start / end when
        ``first`` / ``last``) for ``in_flight`` micro-batches, plus one layer recomputing if checkpointed."""
        one = layers * self.per_layer + (self.first if first else 0) + (self.last if last else 0)
        return in_flight * one + (self.recompute if layers else 0)


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
    context_parallel_size: int = 1,
    context_parallel_mode: str = "ring",
) -> ActivationEstimate:
    """Estimate activation bytes per rank (see the module docstring for the formula).

    ``sharded``: the model went through ``shard_model`` (its dropout modules keep bool masks);
    default: ``tp > 1`` or context parallelism. ``use_cache``: default the config's, as transformers
    does. ``sequence_parallel_regather``: as ShardConfig's (only read with ``sequence_parallel``).
    ``context_parallel_size`` / ``_mode``: as ShardConfig's; ``seq`` is then the whole sequence."""
    kind = getattr(config, "model_type", None)
    if kind not in GPT2_LIKE + LLAMA_LIKE:
        what = f"model_type={kind!r}" if kind else "a model without a transformers config (timm, your own module)"
        raise NotImplementedError(
            f"no activation estimate for {what}; it is derived for {', '.join(GPT2_LIKE + LLAMA_LIKE)}"
        )
    c, mode = context_parallel_size, context_parallel_mode
    for name, value in (("batch", batch), ("seq", seq), ("tp", tp), ("context_parallel_size", c)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} must be 'cpu' or 'cuda' (it sets the size of dropout masks)")
    if mode not in CP_MODES:
        raise ValueError(f"context_parallel_mode={mode!r} is not one of {', '.join(map(repr, CP_MODES))}")
    w, torch_mask = dtype_bytes, (dtype_bytes if device == "cpu" else 1)
    m = 1 if (tp * c > 1 if sharded is None else sharded) else torch_mask  # mask bytes of nn.Dropout modules
    cache = c == 1 and not checkpointing and (config.use_cache if use_cache is None else use_cache)
    h, a, k, d = _heads(config)
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    n = seq if c == 1 else 2 * -(-seq // (2 * c))  # this rank's tokens (the split pads to 2c chunks)
    bs, t = batch * n, tp
    vocab = -(-config.vocab_size // t) * t
    ring, ulysses = c > 1 and mode == "ring", c > 1 and mode == "all_to_all"
    if ring and _attention_dropout(config) > 0:
        raise ValueError(
            f"context_parallel_mode='ring' refuses attention dropout ({_attention_dropout(config)}); "
            f"use context_parallel_mode='all_to_all' (or no attention dropout)"
        )
    full = n * c  # the whole (padded) sequence the all-to-all's attention sees

    if kind in GPT2_LIKE:
        i = config.n_inner or 4 * h
        resid, attn_p, embd = config.resid_pdrop, config.attn_pdrop, config.embd_pdrop
        norms = 2 * bs * h * w  # LayerNorm inputs
        drop = 2 * bs * h * m if resid > 0 else 0
        lse = batch * a * n * 4
        if ring:  # its fp32 output, laid out as q, is the output projection's input in fp32 (a copy otherwise)
            attn = 3 * bs * h * w + lse + (bs * h * 4 if w != 4 else 0)
        elif impl == "sdpa" and attn_p == 0:
            attn = 3 * bs * h * w + (2 * bs * h * w if cache else 0) + lse + (bs * h * w if ulysses else 0)
        else:  # eager, or sdpa's math path (dropout): torch's dropout on the probabilities
            attn = 3 * bs * h * w + _probs(batch, a, n, full if ulysses else n, w, torch_mask, attn_p)
        mlp = (GELU_SAVES.get(config.activation_function, 1) + 1) * bs * i * w
        final_norm, embd_drop = bs * h * w, (bs * h * m if embd > 0 else 0)
    else:
        i = config.intermediate_size
        attn_p = getattr(config, "attention_dropout", 0.0)
        norms, drop = 2 * bs * h * (4 + w), 0  # RMSNorm keeps its input upcast to fp32
        q, kv, lse = bs * a * d * w, 2 * bs * k * d * w, batch * a * n * 4
        if ulysses and (k // t) % c != 0:  # key/value heads repeated for their query heads before the all-to-all
            kv = 2 * bs * a * d * w
        if ring:
            attn = q + kv + lse + (bs * a * d * 4 if w != 4 else 0)
        elif impl == "sdpa" and attn_p == 0:
            attn = q + kv + lse + (bs * a * d * w if ulysses else 0)
        else:
            repeated = 2 * bs * a * d * w if k < a else kv
            probs = _probs(batch, a, n, full if ulysses else n, w, torch_mask, attn_p, softmax_bytes=4)  # fp32 softmax
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
    est.per_layer = bs * h * w // (t if sequence_parallel else 1) if checkpointing else whole + split
    est.first = embd_drop
    est.last = est.parts["final norm + head input"] + est.parts["loss softmax"]
    return est


def _attention_dropout(config) -> float:
    return getattr(config, "attn_pdrop", None) or getattr(config, "attention_dropout", 0.0) or 0.0


def _probs(
    batch: int, heads: int, q_len: int, kv_len: int, w: int, m: int, dropout: float, softmax_bytes: int | None = None
) -> int:
    """Attention probabilities kept by the eager / math path: the softmax output (in fp32 where the model
    upcasts it, then also its cast back), with dropout its mask and the dropped probabilities (which
    the value matmul keeps)."""
    scores = batch * heads * q_len * kv_len
    softmax = w if softmax_bytes in (None, w) else softmax_bytes + w
    return scores * softmax if dropout == 0 else scores * (softmax + m + w)
