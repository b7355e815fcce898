"""Tiny job for the launcher's exit-status tests: ``exit_job.py all-raise | exit-3``.

all-raise: every rank raises; rank 0 first, with a slow teardown (an exit handler that sleeps), so
torchrun stops it (SIGTERM) while it exits, after rank 1's failure reached torchrun. exit-3: rank 1
exits with status 3 while rank 0 waits for it in a collective.
"""

import atexit
import sys
import time

import torch
import torch.distributed as dist

from shardformer import init_distributed

init_distributed()
rank = dist.get_rank()
dist.all_reduce(torch.ones(1))
if sys.argv[1] == "exit-3":
    if rank == 1:
        sys.exit(3)
    dist.all_reduce(torch.ones(1))  # rank 1 never comes: torchrun stops this rank
elif rank == 0:
    atexit.register(time.sleep, 30)
else:
    time.sleep(1)
raise RuntimeError(f"deliberate failure on rank {rank}")
