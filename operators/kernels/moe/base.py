"""The contract of the MoE routed-experts computation (what `moe.Experts` calls).

    out[t] = sum_j weight[t, j] * down_e (act(gate_e x[t]) * up_e x[t]),   e = index[t, j]

with gate_e, up_e the two halves of `gate_up[e]` (gate rows first, as transformers stacks
them) and down_e = `down[e]`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch


class ExpertsKernel:
    """`kernel(x, index, weight, gate_up, down, act) -> out`:

    - x [T, D] (model dtype), index [T, k] long (expert of each of the k choices; an expert
      may have no token, T may be 1), weight [T, k] in x's dtype (the renormalised router
      weights);
    - gate_up [E, 2 * I, D], down [E, D, I] in x's dtype (the stacked expert weights);
    - act: the elementwise activation of the gate half;
    - out [T, D] in x's dtype, a new tensor; no input is modified.

    `name` is for logs. A new implementation: a subclass in its own module, and one `Entry`
    in `MOE` (`moe/__init__.py`), whose target is its `create`.
    """

    name: ClassVar[str] = "base"

    @classmethod
    def create(cls, device, dtype: torch.dtype, dim: int, inner: int) -> ExpertsKernel:
        """The kernel for [E, 2 * inner, dim] / [E, dim, inner] expert weights of `dtype` on
        `device` (called once by `load_model`); override to refuse them (raise `ConfigError`)."""
        return cls()

    def __call__(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


def sort_by_expert(index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """index [T, k] -> (order [T * k]: the k*T slots grouped by expert, ascending and stable;
    tokens [T * k]: the token of each sorted slot; counts [E]: slots per expert)."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, order // index.shape[1], torch.bincount(flat, minlength=num_experts)
