"""Dynamic loss scaling for fp16 training: keep small gradients representable, back off on overflow."""

from __future__ import annotations

import math


class DynamicLossScaler:
    """The loss is multiplied by ``scale`` before backward and the gradients divided by it after.

    A step whose gradients contain inf/NaN (on any rank: the caller reduces the flag) is skipped
    and the scale is multiplied by ``backoff_factor``; after ``growth_interval`` clean steps in a
    row it is multiplied by ``growth_factor``. The scale stays within ``[min_scale, max_scale]``.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        if not (math.isfinite(initial_scale) and initial_scale > 0):
            raise ValueError(f"initial_scale={initial_scale!r} must be a positive finite number, e.g. 2**16")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                f"growth_factor={growth_factor!r} must be > 1 and backoff_factor={backoff_factor!r} in (0, 1); "
                f"the usual values are 2.0 and 0.5"
            )
        if growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval!r} must be at least 1 step")
        if not 0 < min_scale <= initial_scale <= max_scale:
            raise ValueError(
                f"need 0 < min_scale <= initial_scale <= max_scale, got {min_scale}, {initial_scale}, {max_scale}"
            )
        self.scale = float(initial_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])

    def __repr__(self) -> str:
        return f"DynamicLossScaler(scale={self.scale:g}, clean_steps={self.clean_steps})"
