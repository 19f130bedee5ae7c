"""A training-only speed-up: the vision patch embedding as a matmul instead of a Conv3d.

The patch embedding is a Conv3d whose kernel equals its stride, i.e. one linear map
per flattened patch `[N, C*T*P*P] @ [C*T*P*P, D]`; CPU Conv3d backward is many
times slower than that matmul. `use_linear_patch_embed(model)` swaps the forward
of every patch embedding for the equivalent linear one, using the same
`proj.weight` / `proj.bias` parameters, so the saved checkpoint is unchanged.
`test_scenes_training.py` checks the two forwards agree.
"""
from __future__ import annotations


def linear_patch_embed_forward(self, hidden_states):
    """`[N, C*T*P*P]` patches -> `[N, D]` embeddings with the Conv3d's own weights."""
    import torch.nn.functional as F

    weight = self.proj.weight  # [D, C, T, P, P]
    flat = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return F.linear(flat, weight.reshape(weight.shape[0], -1), self.proj.bias)


def use_linear_patch_embed(model) -> int:
    """Rebind the forward of every `*VisionPatchEmbed` module in `model`; returns how many were changed."""
    import types

    changed = 0
    for module in model.modules():
        if type(module).__name__.endswith("VisionPatchEmbed"):
            module.forward = types.MethodType(linear_patch_embed_forward, module)
            changed += 1
    return changed
