"""Settings for tests/cli/all_reduce_job.py (upper case works too: BATCH_SIZE is batch_size)."""

tensor_parallel_size = 2
BATCH_SIZE = 4
steps = 2
