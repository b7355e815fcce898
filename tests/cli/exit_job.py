"""Tiny job for the launcher's exit-status test: every rank fails.

Rank 0 raises first, with a slow teardown (an exit handler that sleeps), so torchrun stops it (SIGTERM)
while it exits, after the failure of rank 1 (``sys.exit(3)`` a second later) reached torchrun.
"""

import atexit
import sys
import time

import torch
import torch.distributed as dist

from shardformer import init_distributed

init_distributed()
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 0:
    atexit.register(time.sleep, 30)
    raise RuntimeError("deliberate failure on rank 0")
time.sleep(1)
sys.exit(3)
