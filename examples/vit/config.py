"""Settings for examples/vit/main.py: a small ViT (transformers or timm) classifying synthetic shapes.

Run:  shardformer run --nproc_per_node 2 examples/vit/main.py --config examples/vit/config.py --mode train
Any key can be changed on the command line: --set backbone=timm --set output_dir=/tmp/vit
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

backbone = "hf"  # "hf": transformers ViTForImageClassification, "timm": timm VisionTransformer

# parallelism: 2 processes = tp 2; num_heads and hidden_size must divide by tensor_parallel_size
tensor_parallel_size = 2
zero_stage = 1
precision = "fp32"

# training: every step draws new images (the data set is generated, so it never runs out)
seed = 42
steps = 60
batch_size = 32  # images per step, over all data-parallel ranks
lr = 2e-3
max_grad_norm = 1.0
log_every = 5

# the model
image_size = 32
patch_size = 8
hidden_size = 64
depth = 2
num_heads = 4

# outputs
output_dir = os.path.normpath(os.path.join(_HERE, "..", "..", "runs", "vit"))  # runs/vit/<backbone>/...
checkpoint_dir = None  # None: <output_dir>/<backbone>/checkpoint

# inference
num_test_images = 9
compare_untrained = True  # also print what the untrained model predicts
