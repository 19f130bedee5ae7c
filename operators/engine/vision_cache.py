"""Vision features by media content hash: each distinct image / video is encoded once.

`get(hash)` returns the cached `[N_vis, D]` features (and refreshes LRU order), `put`
stores them and evicts least recently used entries beyond `budget_bytes`. An entry larger
than the whole budget is not kept (the caller still uses the features it computed).
A budget of 0 disables caching. Counters (`hits`, `misses`) feed the engine stats.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class VisionCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        feats = self._entries.get(key)
        if feats is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return feats

    def put(self, key: str, feats: torch.Tensor) -> None:
        size = feats.numel() * feats.element_size()
        if size > self.budget_bytes or key in self._entries:
            return
        self._entries[key] = feats
        self.nbytes += size
        while self.nbytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
