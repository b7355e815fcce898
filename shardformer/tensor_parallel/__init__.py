"""Tensor parallelism: the sharder, the slicer, the parallel layers, sequence parallelism, recompute, the LM head."""
