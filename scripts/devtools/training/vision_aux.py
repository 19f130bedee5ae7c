"""The auxiliary vision loss: a linear head on the merger's output, trained on per-token targets.

Why it exists: see `token_labels`. `VisionAux(model)` hooks the vision merger of a
transformers Qwen3.5 model and keeps every output it produces during a forward
(images first, then videos, as the reference calls them), so the language loss and
this loss share one vision forward. The head is training-only: it is not part of
the saved checkpoint, which stays a plain Qwen3.5 model.

    aux = VisionAux(model)
    loss = model(**inputs).loss + weight * aux.loss(targets)   # targets [N, 3]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlbatch.devtools.training.token_labels import IGNORE, N_COLOUR, N_KIND, N_MOTION, N_SIZE, POSITION_BINS

_SPLITS = (N_COLOUR, N_KIND, N_SIZE, POSITION_BINS, POSITION_BINS, N_MOTION)
NAMES = ("colour", "kind", "size", "row", "col", "motion")
_ON_SHAPES = {0, 1, 2, 5}  # heads whose accuracy is reported on shape tokens only (target > 0)


class VisionAux(torch.nn.Module):
    """Linear head `[N, D] -> [N, colour | kind | size | row | col | motion]` over the merger outputs of the
    last forward."""

    def __init__(self, model):
        super().__init__()
        visual = model.model.visual
        width = visual.merger.linear_fc2.out_features
        self.head = torch.nn.Linear(width, sum(_SPLITS))
        self._outputs: list[torch.Tensor] = []
        self._hook = visual.merger.register_forward_hook(lambda _m, _i, out: self._outputs.append(out))

    def encode(self, model, batch: dict) -> None:
        """Run only the vision tower on a batch's media (the vision-only stage)."""
        if batch.get("pixel_values") is not None:
            model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
        if batch.get("pixel_values_videos") is not None:
            model.model.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"])

    def _logits(self) -> list[torch.Tensor]:
        feats = torch.cat(self._outputs)  # [N, D]
        self._outputs.clear()
        return list(torch.split(self.head(feats), _SPLITS, dim=-1))

    def loss(self, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the six heads; `targets [N, 6]` (IGNORE where unlabelled)."""
        total = torch.zeros(())
        for k, logits in enumerate(self._logits()):
            if (targets[:, k] != IGNORE).any():
                total = total + F.cross_entropy(logits, targets[:, k], ignore_index=IGNORE)
        return total

    @torch.no_grad()
    def accuracy(self, targets: torch.Tensor) -> dict[str, float]:
        """Accuracy per head, for logs: on shape tokens (target > 0) for colour / kind / size / motion, all
        for places."""
        out = {}
        for k, (name, logits) in enumerate(zip(NAMES, self._logits(), strict=True)):
            mask = targets[:, k] > 0 if k in _ON_SHAPES else targets[:, k] != IGNORE
            if mask.any():
                out[name] = float((logits.argmax(-1)[mask] == targets[mask, k]).float().mean())
        return out

    def clear(self) -> None:
        self._outputs.clear()

    def remove(self) -> None:
        self._hook.remove()
