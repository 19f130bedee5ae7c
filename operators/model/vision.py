"""The vision tower: packed patches [N_patch, C*T*P*P] -> merged visual tokens [N_patch / m^2, D_out].

Seed 000 section 6, per media item with grid (t, h, w) in patches:
1. Patch embedding: the checkpoint's Conv3d with kernel = stride = (T, P, P) is one
   linear map of each packed patch vector, applied here as `F.linear` with the conv
   weight viewed [D, C*T*P*P] (same numbers, no 5-D reshape).
2. Learned positions: the [side, side, D] table resampled bilinearly to (h, w) with
   align_corners (row r reads table row r * (side - 1) / (h - 1)), put in the
   processor's block order (m x m blocks, row-major inside and across blocks), repeated
   over the t temporal groups; added to the patch embeddings.
3. 2D RoPE over the full head from each patch's (row, col) (`rope.vision_rope`).
4. `depth` pre-norm blocks: LayerNorm -> bidirectional MHA -> residual, LayerNorm ->
   GELU MLP -> residual. Attention stays inside one temporal group of one item (the
   cu_seqlens segments of length h * w).
5. Merger: LayerNorm per patch, concatenate each m x m block ([N / m^2, m^2 * D]),
   Linear -> GELU -> Linear to the decoder width.
Parameter names equal the checkpoint's `model.visual.*` names.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlbatch.operators.model.config import VisionConfig
from vlbatch.operators.model.layers import activation, embedding
from vlbatch.operators.model.rope import apply_full_rope, vision_rope


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C*T*P*P] -> [N, D]."""
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[tuple[int, int]]):
        """x [N, D]; segments: (count, length) runs of equal-length attention groups, in order."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)  # [N, H, d] each
        q, k = apply_full_rope(q, cos, sin), apply_full_rope(k, cos, sin)
        outs, start = [], 0
        for count, length in segments:
            rows = slice(start, start + count * length)
            qs, ks, vs = (t[rows].view(count, length, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs)  # [count, H, length, d]
            outs.append(o.transpose(1, 2).reshape(count * length, -1))
            start += count * length
        return self.proj(torch.cat(outs, dim=0))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] in block order -> [N / m^2, D_out]."""
        x = self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self.grid_tables = GridTables()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N_patch, C*T*P*P], grid_thw [n, 3] -> [N_patch / m^2, D_out]."""
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        x = self.patch_embed(pixel_values)
        tables = [self._tables(h, w, x.device) for _, h, w in grids]
        pos, cos, sin = (_repeat_cat([(t[i], g[0]) for t, g in zip(tables, grids, strict=True)]) for i in range(3))
        x = x.add_(pos.to(x.dtype))  # x: the patch embedding's fresh output
        segments = [(t, h * w) for t, h, w in grids]
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger(x)

    def _tables(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [h * w, D], rope cos, sin [h * w, head_dim]) float32 of an h x w grid in
        block order: made once per grid size (and position table), then served from `grid_tables`."""
        weight = self.pos_embed.weight
        key = (h, w, str(device), weight.data_ptr(), weight._version)  # reloaded weights: new entries
        hit = self.grid_tables.get(key)
        if hit is None:
            row, col = self._block_coords(h, w, device)
            hit = (self._positions(h, w).to(device), *vision_rope(row, col, self.cfg.head_dim, self.cfg.rope_theta))
            self.grid_tables.put(key, hit)
        return hit

    def _block_coords(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) of each patch of an h x w grid in block order: [h * w] each."""
        m = self.cfg.spatial_merge_size
        r = torch.arange(h, device=device)[:, None].expand(h, w)
        c = torch.arange(w, device=device)[None, :].expand(h, w)
        order = lambda a: a.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)  # noqa: E731
        return order(r), order(c)

    def _positions(self, h: int, w: int) -> torch.Tensor:
        """Bilinear (align_corners) resample of the position table to h x w, block order: [h * w, D]."""
        side = self.cfg.grid_side
        table = self.pos_embed.weight.view(side, side, -1).float()
        r0, r1, fr = _taps(h, side, table.device)
        c0, c1, fc = _taps(w, side, table.device)
        fr, fc = fr[:, None, None], fc[None, :, None]
        grid = (
            table[r0][:, c0] * (1 - fr) * (1 - fc)
            + table[r0][:, c1] * (1 - fr) * fc
            + table[r1][:, c0] * fr * (1 - fc)
            + table[r1][:, c1] * fr * fc
        )  # [h, w, D]
        m = self.cfg.spatial_merge_size
        return grid.reshape(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)


def _taps(size: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_corners source coordinates for `size` targets on a `side` table: (lo, hi, frac) [size]."""
    src = torch.arange(size, dtype=torch.float32, device=device) * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    return lo.long(), (lo.long() + 1).clamp(max=side - 1), src - lo


def _repeat_cat(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """[(table [n_i, X], t_i)] -> [sum t_i n_i, X]: each table repeated t_i times, in order (no
    copy for one still image)."""
    if len(parts) == 1 and parts[0][1] == 1:
        return parts[0][0]
    return torch.cat([table.repeat(t, 1) for table, t in parts])


class GridTables:
    """A vision tower's per-grid-size tables (positions, rope cos / sin), oldest dropped first
    beyond `max_bytes`: images of a dataset share a few sizes, and each size's tables cost
    ~15 small ops (0.4 ms on a CPU core at 560 patches; kernel launches on a GPU)."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._entries: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def get(self, key: tuple) -> tuple[torch.Tensor, ...] | None:
        return self._entries.get(key)

    def put(self, key: tuple, tables: tuple[torch.Tensor, ...]) -> None:
        size = sum(t.numel() * t.element_size() for t in tables)
        if size > self.max_bytes:
            return  # larger than the whole cache: made for this call only
        while self.nbytes + size > self.max_bytes:
            old = self._entries.pop(next(iter(self._entries)))
            self.nbytes -= sum(t.numel() * t.element_size() for t in old)
        self._entries[key] = tables
        self.nbytes += size
