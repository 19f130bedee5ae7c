"""Rotary position embeddings: interleaved partial MRoPE for the decoder, 2D RoPE for the ViT.

Text (seed 000 section 11): each token has (t, h, w) positions [3, T]. The rotated part
of a head is `rotary_dim = head_dim * partial_rotary_factor` dims, i.e. rotary_dim / 2
frequencies `theta^(-2j / rotary_dim)`. Frequency j takes its position from axis
T, H, W, T, H, W, ... (j % 3), limited by mrope_section: index j uses H when j % 3 == 1
and j < 3 * section[1], W when j % 3 == 2 and j < 3 * section[2], T otherwise.
cos / sin are [T, rotary_dim] in the rotate_half layout (frequencies repeated twice).

Vision (section 6.3): head_dim / 4 frequencies `theta^(-4j / head_dim)` applied to the
patch row and column; angles [N, head_dim] = cat(row, col, row, col), rotating the
full head.
"""
from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def text_rope(
    position_ids: torch.Tensor, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [3, T] (t, h, w) -> (cos, sin) [T, rotary_dim], float32."""
    device = position_ids.device
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    j = torch.arange(rotary_dim // 2, device=device)
    axis = torch.zeros_like(j)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    pos = position_ids.float()[axis]  # [F, T]: the axis each frequency reads
    freqs = pos.transpose(0, 1) * inv_freq  # [T, F]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos / sin [T, R] with R <= D: rotate the first R dims of each head."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def vision_rope(rows: torch.Tensor, cols: torch.Tensor, head_dim: int,
                theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rows / cols [N] patch coordinates -> (cos, sin) [N, head_dim], float32."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=rows.device) / half))
    fr = rows.float()[:, None] * inv_freq
    fc = cols.float()[:, None] * inv_freq
    emb = torch.cat([fr, fc, fr, fc], dim=-1)
    return emb.cos(), emb.sin()


def apply_full_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D], cos / sin [N, D]; computed in float32, returned in x's dtype."""
    xf = x.float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
