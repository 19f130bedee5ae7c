"""Vision features by media content hash, behind one contract (`VisionCache`): the LRU
cache (`LRUVisionCache`, each distinct image / video is encoded once) and `NoVisionCache`
(caching off).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

import torch


class VisionCache(ABC):
    """What the model runner uses of a vision cache.

    - `get(hash) -> [N_vis, D] | None`: the features stored for a media content hash
      (`MediaItem.content_hash`), None on a miss.
    - `put(hash, feats)`: offer features just computed; the cache may keep them or not
      (the caller uses the features it computed either way).
    - `stats() -> dict`: `vision_cache_bytes` held now.
    """

    @abstractmethod
    def get(self, key: str) -> torch.Tensor | None: ...

    @abstractmethod
    def put(self, key: str, feats: torch.Tensor) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, int]: ...


class NoVisionCache(VisionCache):
    """Vision caching off: every lookup misses, nothing is kept."""

    def get(self, key: str) -> None:
        return None

    def put(self, key: str, feats: torch.Tensor) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"vision_cache_bytes": 0}


class LRUVisionCache(VisionCache):
    """`get` refreshes LRU order; `put` stores and evicts least recently used entries beyond
    `budget_bytes`. An entry larger than the whole budget is not kept. Counters (`hits`,
    `misses`) count lookups."""

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

    def stats(self) -> dict[str, int]:
        return {"vision_cache_bytes": self.nbytes}

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
