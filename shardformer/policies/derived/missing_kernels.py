"""Modules whose code computes nothing without a custom kernel that is not loaded.

transformers' MRA computes its attention with a custom CUDA kernel (``mra_cuda_kernel``, loaded from the
hub with the ``kernels`` package on a CUDA machine); where it is not loaded, ``mra2_attention`` returns
zeros shaped like the queries. The model runs, but its attention is none: the output projection reads
zeros. A group whose row reads all zeros, in a module whose code's kernel is None, is refused naming the
kernel, rather than with whatever error cutting a computation that never happened gives.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from shardformer.core.refusal import DATA_PARALLEL, Reason


def missing_kernels(parent: nn.Module) -> list[str]:
    """``module.name`` of the module-level kernels the code of ``parent``'s modules holds as None."""
    found = []
    for module_name in dict.fromkeys(type(m).__module__ for m in parent.modules()):
        names = vars(sys.modules[module_name]) if module_name in sys.modules else {}
        found += [f"{module_name}.{n}" for n, value in names.items() if value is None and "kernel" in n.lower()]
    return found


def zeros_without_kernel(parent: nn.Module, row: str, row_input) -> Reason | None:
    """Why the group writing ``row`` is not cut when its input is all zeros for want of a kernel, or None."""
    if not torch.is_tensor(row_input) or not row_input.numel() or bool(row_input.any()):
        return None
    missing = missing_kernels(parent)
    if not missing:
        return None
    text = (
        f"{row} reads all zeros in the unsharded model's own forward: {type(parent).__name__}'s code computes "
        f"with a custom kernel that is not loaded ({', '.join(missing)} is None), and without it returns zeros "
        f"in its place, so there is nothing to cut or prove here"
    )
    fix = (
        "load the kernel first (transformers loads it on a CUDA machine with the `kernels` package installed) "
        f"and shard the model there, or {DATA_PARALLEL}"
    )
    return Reason(text, fix)
