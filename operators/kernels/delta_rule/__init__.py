"""The gated delta rule behind one contract (`base.DeltaRuleKernels`: packed prefill from
per-sequence states, in-place decode).

Implementations: `torch_rule.TorchDeltaRule` (every device; built on `packed.py` and
`chunked.py`, and on the CPU the compiled decode step of `cpu_decode.py`), `fla_rule.FlaDeltaRule` (flash-linear-attention's Triton kernels, CUDA) and
`naive.NaiveDeltaRule` (the seed's loop, the test reference).

`select_delta_rule(device, choice)` is called once by `load_model`: "torch" always works;
"fla" needs CUDA and the `fla` package (flash-linear-attention / fla-core); "auto" (the
default) takes fla on CUDA when it is installed, else torch.
`python -m vlbatch.operators.kernels.delta_rule` is the GPU check (`check.py`).
"""
from __future__ import annotations

import torch

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.kernels.delta_rule import cpu_decode, cpu_scan
from vlbatch.operators.kernels.delta_rule.base import DeltaRuleKernels
from vlbatch.operators.kernels.delta_rule.fla_rule import FlaDeltaRule, fla_installed, fla_kernels
from vlbatch.operators.kernels.delta_rule.naive import NaiveDeltaRule
from vlbatch.operators.kernels.delta_rule.torch_rule import TorchDeltaRule

CHOICES = ("auto", "torch", "fla")

__all__ = ["CHOICES", "DeltaRuleKernels", "FlaDeltaRule", "NaiveDeltaRule", "TorchDeltaRule", "fla_installed",
           "fla_kernels", "select_delta_rule"]


def select_delta_rule(device: str | torch.device, choice: str = "auto") -> DeltaRuleKernels:
    """The kernels for a model on `device`: see the module docstring."""
    if choice not in CHOICES:
        raise ConfigError(f"delta_kernels={choice!r}; allowed: {', '.join(CHOICES)}")
    on_cuda = torch.device(device).type == "cuda"
    if choice == "torch" or (choice == "auto" and not (on_cuda and fla_installed())):
        if torch.device(device).type == "cpu":
            cpu_decode.warm_up()  # at load, not in the first decode step
            cpu_scan.warm_up()
        return TorchDeltaRule()
    if not on_cuda:
        raise ConfigError(f"delta_kernels='fla' needs a CUDA device, the model is on {device}")
    if not fla_installed():
        raise ConfigError("delta_kernels='fla' needs flash-linear-attention (pip install flash-linear-attention)")
    return fla_kernels()
