"""`make demo`: the best end-to-end run the library has so far, on 2 CPU processes (gloo)."""

from __future__ import annotations

import torch.distributed as dist

from shardformer.mesh import ProcessMesh
from shardformer.testing import run_on_ranks


def _show_mesh():
    mesh = ProcessMesh(tp_size=2)
    return repr(mesh)


def main() -> None:
    for line in run_on_ranks(_show_mesh, 2):
        print(line)
    assert not dist.is_initialized()


if __name__ == "__main__":
    main()
