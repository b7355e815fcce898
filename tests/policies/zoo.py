"""Tiny models of every supported class, saved and loaded with from_pretrained, and inputs for them."""

import shutil
import tempfile

import torch
import torch.distributed as dist
import transformers as tf

VOCAB = 99  # divides by neither 2 nor 4: the vocabulary is padded
SEQ, BATCH, CHOICES, LABELS = 8, 2, 2, 3
NO_DROPOUT_GPT2 = {
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "summary_first_dropout": 0.0,
    "classifier_dropout": 0.0,
}
NO_DROPOUT_BERT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def gpt2_config(num_labels=LABELS, **kw):
    return tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, num_labels=num_labels,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **NO_DROPOUT_GPT2, **kw,
    )  # fmt: skip


def bert_config(num_labels=LABELS, **kw):
    return tf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, num_labels=num_labels, **NO_DROPOUT_BERT, **kw,
    )  # fmt: skip


def vit_config(**kw):
    return tf.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=LABELS, encoder_stride=4, **NO_DROPOUT_BERT, **kw,
    )  # fmt: skip


GPT2 = ["GPT2Model", "GPT2LMHeadModel", "GPT2DoubleHeadsModel", "GPT2ForSequenceClassification",
        "GPT2ForTokenClassification", "GPT2ForQuestionAnswering"]  # fmt: skip
BERT = ["BertModel", "BertForPreTraining", "BertForMaskedLM", "BertLMHeadModel", "BertForNextSentencePrediction",
        "BertForSequenceClassification", "BertForMultipleChoice", "BertForTokenClassification",
        "BertForQuestionAnswering"]  # fmt: skip
VIT = ["ViTModel", "ViTForImageClassification", "ViTForMaskedImageModeling"]


def config_for(name):
    labels = 2 if name.endswith("QuestionAnswering") else LABELS  # start and end logits
    if name.startswith("GPT2"):
        return gpt2_config(num_labels=labels)
    if name.startswith("Bert"):
        return bert_config(is_decoder=name == "BertLMHeadModel", num_labels=labels)
    return vit_config()


def load_twice(name, attn_implementation="eager", seed=0, config=None):
    """Build ``name`` from a tiny config, save it, and load it back twice (reference and to-be-sharded).

    With torch.distributed up, transformers writes files on rank 0 only: rank 0 saves into a folder
    every rank can read, and the others wait for it.
    """
    cls = getattr(tf, name)
    rank = dist.get_rank() if dist.is_initialized() else 0
    box = [tempfile.mkdtemp(prefix="sf-zoo-") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    path = box[0]
    if rank == 0:
        torch.manual_seed(seed)
        cls(config or config_for(name)).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    models = [cls.from_pretrained(path, attn_implementation=attn_implementation) for _ in range(2)]
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(path)
    return models


def inputs_for(name, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = lambda *shape: torch.randint(3, VOCAB, shape, generator=g)
    cls = lambda n, *shape: torch.randint(0, n, shape, generator=g)
    if name.startswith("ViT"):
        x = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g)}
        if name == "ViTForImageClassification":
            x["labels"] = cls(LABELS, BATCH)
        if name == "ViTForMaskedImageModeling":
            x["bool_masked_pos"] = torch.rand(BATCH, 16, generator=g) < 0.5
        return x
    if name in ("GPT2DoubleHeadsModel", "BertForMultipleChoice"):
        x = {"input_ids": ids(BATCH, CHOICES, SEQ)}
        if name == "GPT2DoubleHeadsModel":
            x.update(
                mc_token_ids=cls(SEQ, BATCH, CHOICES), mc_labels=cls(CHOICES, BATCH), labels=x["input_ids"].clone()
            )
            x["labels"][0, 0, :3] = -100
        else:
            x["labels"] = cls(CHOICES, BATCH)
        return x
    x = {"input_ids": ids(BATCH, SEQ)}
    if name.startswith("Bert"):
        x["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
        x["attention_mask"][1, -2:] = 0  # padding must be masked the same way in both
    labels = {
        "GPT2LMHeadModel": lambda: x["input_ids"].masked_fill(torch.rand(BATCH, SEQ, generator=g) < 0.2, -100),
        "BertLMHeadModel": lambda: x["input_ids"].clone(),
        "BertForMaskedLM": lambda: x["input_ids"].masked_fill(torch.rand(BATCH, SEQ, generator=g) < 0.6, -100),
        "BertForPreTraining": lambda: x["input_ids"].masked_fill(torch.rand(BATCH, SEQ, generator=g) < 0.6, -100),
        "BertForNextSentencePrediction": lambda: cls(2, BATCH),
        "BertForSequenceClassification": lambda: cls(LABELS, BATCH),
        "GPT2ForSequenceClassification": lambda: cls(LABELS, BATCH),
        "BertForTokenClassification": lambda: cls(LABELS, BATCH, SEQ),
        "GPT2ForTokenClassification": lambda: cls(LABELS, BATCH, SEQ),
    }
    if name in labels:
        x["labels"] = labels[name]()
    if name == "BertForPreTraining":
        x["next_sentence_label"] = cls(2, BATCH)
    if name.endswith("QuestionAnswering"):
        x.update(start_positions=cls(SEQ, BATCH), end_positions=cls(SEQ, BATCH))
    return x


def timm_pair(seed=0, **kw):
    import timm

    def make():
        torch.manual_seed(seed)
        return timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=32, depth=2,
            num_heads=4, num_classes=LABELS, **kw,
        )  # fmt: skip

    return make(), make()
