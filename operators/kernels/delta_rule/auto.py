"""`auto`, the default delta-rule choice: fla's Triton kernels where they run, else torch."""
from __future__ import annotations

import torch

from vlbatch.operators.kernels.delta_rule import fla_rule, select_delta_rule
from vlbatch.operators.kernels.delta_rule.base import DeltaRuleKernels


def auto(device) -> DeltaRuleKernels:
    """`fla` on CUDA when flash-linear-attention is installed, else `torch`."""
    use_fla = torch.device(device).type == "cuda" and fla_rule.fla_installed()
    return select_delta_rule(device, "fla" if use_fla else "torch")
