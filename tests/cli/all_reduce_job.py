"""Tiny job for the launcher tests: load the config, join the group, build the mesh, all-reduce once."""

import sys

import torch
import torch.distributed as dist

from shardformer import ProcessMesh, init_distributed
from shardformer.cli import Key, parse_example_args

cfg, mode = parse_example_args(extra_keys={"crash_rank": Key(int, None, "rank that raises on purpose")})
init_distributed()
mesh = ProcessMesh(tp_size=cfg.tensor_parallel_size, pp_size=cfg.pipeline_parallel_size, dp_size=cfg.data_parallel_size)
if mesh.rank == cfg.crash_rank:
    raise RuntimeError(f"deliberate failure on rank {mesh.rank}")
total = torch.tensor([float(mesh.rank + 1)])
dist.all_reduce(total)  # the other ranks wait here when one crashed: the job must still end
# One write per line: ranks share the terminal, and print() writes the newline separately.
sys.stdout.write(
    f"rank {mesh.rank}/{mesh.world_size} mode={mode} tp={mesh.tp_size} sum={total.item():g} batch_size={cfg.batch_size}\n"
)
sys.stdout.flush()
dist.destroy_process_group()
