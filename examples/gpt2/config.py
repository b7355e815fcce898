"""Settings for examples/gpt2/main.py: a small word-level GPT-2 trained on data/corpus.txt.

Run:  shardformer run --nproc_per_node 2 examples/gpt2/main.py --config examples/gpt2/config.py --mode train
Any key can be changed on the command line: --set steps=50 --set output_dir=/tmp/gpt2
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

# parallelism: 2 processes = tp 2 x dp 1 (4 processes would add dp 2)
tensor_parallel_size = 2
zero_stage = 1  # AdamW states sharded over the data-parallel group
precision = "fp32"

# training
seed = 42
steps = 150
batch_size = 16  # sequences per step, over all data-parallel ranks
lr = 3e-3
max_grad_norm = 1.0
log_every = 5

# data and outputs
data_path = os.path.join(_HERE, "data", "corpus.txt")
output_dir = os.path.normpath(os.path.join(_HERE, "..", "..", "runs", "gpt2"))  # initial/, checkpoint/, loss_curve.png
checkpoint_dir = None  # None: <output_dir>/checkpoint

# the model (GPT2Config): n_embd and n_head must divide by tensor_parallel_size
n_layer = 2
n_embd = 96
n_head = 4
block_size = 64  # tokens (words and punctuation marks) per training sequence
dropout = 0.0  # GPT-2's dropouts (embeddings, attention, residual); the corpus is small: none

# inference
prompt = "The keeper"
max_new_tokens = 30
compare_untrained = True  # also print what the untrained model says
