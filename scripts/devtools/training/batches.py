"""Training batches: scene items -> transformers processor inputs with answer-only labels.

Each example is the single-turn chat the model will see at inference (generation
prompt with thinking disabled, i.e. ending in `<think>\n\n</think>\n\n`) followed
by the answer and `<|im_end|>`. Labels are -100 everywhere except the answer and
`<|im_end|>` tokens, so the model learns to answer and to stop. Right padding keeps
every example's tokens at the same positions as unpadded (causal model, padded tail).
"""
from __future__ import annotations

import numpy as np

from vlbatch.devtools.scenes.heldout import SceneItem, image_item, video_item
from vlbatch.devtools.scenes.texts import IMAGE_TASKS, VIDEO_TASKS

END = "<|im_end|>"
IGNORE = -100
# task weights within a modality (captions are longest, so they get more examples)
IMAGE_WEIGHTS = {"caption": 0.3, "count": 0.15, "colour": 0.2, "shape": 0.15, "position": 0.2}
VIDEO_WEIGHTS = {"video_caption": 0.3, "motion": 0.3, "colour_start": 0.2, "colour_end": 0.2}


def sample_items(rng: np.random.Generator, n: int, video_share: float, seed_limit: int,
                 image_weights: dict[str, float] | None = None) -> list[SceneItem]:
    """`n` random training items, scene seeds drawn from `[0, seed_limit)` (below the held-out range).

    `image_weights` (task -> weight, normalised here) replaces `IMAGE_WEIGHTS`.
    """
    weights = np.array([(image_weights or IMAGE_WEIGHTS)[t] for t in IMAGE_TASKS], dtype=np.float64)
    weights /= weights.sum()
    items = []
    for _ in range(n):
        seed = int(rng.integers(seed_limit))
        if rng.random() < video_share:
            task = VIDEO_TASKS[int(rng.choice(len(VIDEO_TASKS), p=list(VIDEO_WEIGHTS.values())))]
            items.append(video_item(seed, task, rng))
        else:
            task = IMAGE_TASKS[int(rng.choice(len(IMAGE_TASKS), p=weights))]
            items.append(image_item(seed, task, rng))
    return items


def prompt_text(processor, item: SceneItem) -> str:
    """The generation prompt of an item (thinking disabled), before visual-token expansion."""
    return processor.apply_chat_template(item.messages(), add_generation_prompt=True, enable_thinking=False)


def media_kwargs(items: list[SceneItem]) -> dict:
    """`images` / `videos` + `video_metadata` kwargs for the reference processor, in item order."""
    from transformers.video_utils import VideoMetadata

    images = [it.image for it in items if it.media_type == "image"]
    clips = [it.video for it in items if it.media_type == "video"]
    kwargs: dict = {}
    if images:
        kwargs["images"] = images
    if clips:
        kwargs["videos"] = [c.frames for c in clips]
        kwargs["video_metadata"] = [
            VideoMetadata(total_num_frames=c.total_frames, fps=c.source_fps, frames_indices=list(c.indices))
            for c in clips
        ]
        kwargs["do_sample_frames"] = False  # frames are already sampled exactly as the reference samples them
    return kwargs


def collate(processor, items: list[SceneItem]) -> dict:
    """Model inputs (torch tensors) with `labels [B, L]` on the answer tokens only."""
    import torch

    tok = processor.tokenizer
    tok.padding_side = "right"
    texts, answer_lens = [], []
    for it in items:
        answer = it.qa.answer + END
        texts.append(prompt_text(processor, it) + answer)
        answer_lens.append(len(tok(answer, add_special_tokens=False)["input_ids"]))
    batch = processor(text=texts, padding=True, return_tensors="pt", **media_kwargs(items))
    labels = torch.full_like(batch["input_ids"], IGNORE)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    for row, (length, n) in enumerate(zip(lengths, answer_lens, strict=True)):
        labels[row, length - n : length] = batch["input_ids"][row, length - n : length]
    batch["labels"] = labels
    return dict(batch)


def vision_targets(batch: dict, items: list[SceneItem]):
    """`[N, 6]` long tensor of per-token targets (see `token_labels`) in the merger's output order.

    The reference model encodes all images of a batch first, then all videos, each in item order.
    """
    import torch

    from vlbatch.devtools.training.token_labels import image_targets, video_targets

    images = [it for it in items if it.media_type == "image"]
    videos = [it for it in items if it.media_type == "video"]
    parts = [image_targets(it.scene, g) for it, g in zip(images, batch.get("image_grid_thw", []), strict=True)]
    parts += [video_targets(it.video.frames, g, it.scene.shapes)
              for it, g in zip(videos, batch.get("video_grid_thw", []), strict=True)]
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros((0, 6), dtype=torch.long)
