"""The float64 rerun's mode: float32 asked for anywhere becomes float64.

A comparison that fails in float32 is run again in float64, where float32 rounding (summation order over
ranks, amplified by the model) shrinks by orders of magnitude and a wrong cut does not. Many models compute
parts in float32 whatever their dtype — norms calling ``.float()``, routers ``F.linear(x.float(), ...)``,
softmax with ``dtype=torch.float32``, rotary tables from ``arange(...).float()`` — and a ``.double()`` copy of
them still rounds to float32 there, so its rerun cannot tell rounding from a wrong cut. Inside
:class:`Float64Everywhere` those requests give float64 instead, in both copies alike: the comparison is of
the same function computed two ways, now without a float32 step anywhere.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


def _wider(value):
    return torch.float64 if value is torch.float32 else value


class Float64Everywhere(TorchFunctionMode):
    """Within it, ``Tensor.float()`` gives float64, every ``torch.float32`` given as an argument
    (``.to(...)``, ``.type(...)``, ``dtype=...``) is read as ``torch.float64``, and the default dtype is
    float64 (a module built inside, as the proof's tiny copy is, gets float64 parameters throughout, not
    float64 where its code names float32 and float32 elsewhere)."""

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].to(torch.float64, *args[1:], **kwargs)  # the mode is off inside its own handler
        args = tuple(_wider(a) for a in args)
        kwargs = {k: _wider(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
