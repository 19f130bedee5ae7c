"""`Processor`: chat messages + decoded media -> model inputs, identical to the reference.

Owns the public preprocessing API (its contract is this docstring; ARCHITECTURE.md points here):

    proc = Processor.from_pretrained(model_dir)
    text = proc.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    inputs = proc(text=text, images=[rgb_uint8_hw3], videos=[VideoClip])

`inputs` is a dict of numpy arrays named and shaped as transformers'
`Qwen3VLProcessor(..., return_tensors="np")` returns them, plus MRoPE ids:

    input_ids, attention_mask, mm_token_type_ids   int64 [B, L]
    pixel_values          float32 [N_img_patches, C*tp*p*p]   (when images are given)
    image_grid_thw        int64 [num_images, 3]
    pixel_values_videos   float32 [N_vid_patches, C*tp*p*p]   (when videos are given)
    video_grid_thw        int64 [num_videos, 3]
    position_ids          int64 [3, B, L]   (= Qwen3_5Model.get_rope_index)
    rope_deltas           int64 [B]

`encode_media(..., uint8=True)` is the pipeline's second output mode: the same arrays with
the pixel values left as the resized uint8 levels (same block-major layout, 4x fewer
bytes); `vlbatch.operators.model.pixels.normalize_patches(patches, norm_table(kind))`
gives the float32 values above bit for bit. `encode_media(..., frames=True)` (one media) is
what the pipeline ships: the resized uint8 frames `[F, h, w, 3]` themselves, no patch layout
(`normalize_frames(frames, norm_table(kind), patch=, merge=, temporal=)` gives the same values).

Videos are `VideoClip`s whose frames are already sampled (the decoder applied
`sample_frame_indices`); the processor never resamples. Media are consumed in
placeholder order across the batch. Rows are padded on the tokenizer's
padding side. Bad input raises `InputError`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlbatch.operators.errors import ConfigError, InputError
from vlbatch.operators.preprocess.config import ImageConfig, VideoConfig, load_image_config, load_video_config
from vlbatch.operators.preprocess.prompt import PromptEncoder, pad_batch
from vlbatch.operators.preprocess.rope import mrope_position_ids
from vlbatch.operators.preprocess.user_text import ChatText
from vlbatch.operators.preprocess.visual import plan_video, process_images, process_videos
from vlbatch.operators.storage.named_file import checkpoint_text
from vlbatch.operators.types import VideoClip, VideoPlan


@dataclass(frozen=True)
class MediaInputs:
    """`Processor.encode_media`'s result: the visual arrays (`pixel_values` / `image_grid_thw`
    and / or the `_videos` pair) and, per media in order, its placeholder size: merged tokens
    per image, (tokens per temporal group, group timestamps) per video."""

    arrays: dict[str, np.ndarray]
    image_tokens: tuple[int, ...]
    video_parts: tuple[tuple[int, tuple[float, ...]], ...]


class Processor:
    """Tokenizer + chat template + image/video preprocessing of one checkpoint."""

    def __init__(self, tokenizer, chat_template: str | None, image_config: ImageConfig, video_config: VideoConfig,
                 spatial_merge_size: int):
        self.prompts = PromptEncoder(tokenizer, chat_template)
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.video_config = video_config
        self.spatial_merge_size = spatial_merge_size
        self._luts: dict = {}  # Normalization -> [3, 256] float32 (configs may be replaced after init)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Processor:
        """Read tokenizer, chat_template.jinja and the two processor configs from a checkpoint folder."""
        from vlbatch.operators.preprocess.tokenizer import load_tokenizer

        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model_dir {str(path)!r} is not a folder")
        tokenizer = load_tokenizer(path)
        template = tokenizer.chat_template  # chat_template.jinja, else tokenizer_config.json's (both loaders)
        image_cfg = load_image_config(path)
        merge = image_cfg.merge_size
        cfg_file = path / "config.json"
        if cfg_file.exists():
            merge = int(json.loads(checkpoint_text(cfg_file)).get("vision_config", {}).get("spatial_merge_size", merge))
        return cls(tokenizer, template, image_cfg, load_video_config(path), merge)

    def _lut(self, norm) -> np.ndarray:
        if norm not in self._luts:
            self._luts[norm] = norm.lut(3)
        return self._luts[norm]

    def norm_table(self, kind: str) -> np.ndarray:
        """float32 `[3, 256]`: the normalised value of every uint8 level of an "image" / "video"."""
        if kind not in ("image", "video"):
            raise InputError(f"media kind must be 'image' or 'video', got {kind!r}")
        return self._lut((self.image_config if kind == "image" else self.video_config).norm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = False, **template_kwargs) -> str:
        """Render `messages` ({"role", "content"} dicts; content a string or a list of
        {"type": "text"|"image"|"video", ...} parts) with the checkpoint's chat template."""
        return self.prompts.render(messages, add_generation_prompt=add_generation_prompt,
                                   enable_thinking=enable_thinking, **template_kwargs)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = False,
                  **template_kwargs) -> ChatText:
        """`apply_chat_template`'s prompt with its user text located (`ChatText.text` is that string):
        `encode_text` / `__call__` tokenise the messages' text fields as text, so a control-token
        string in them (`<|im_end|>`, `<|image_pad|>`) is never a control token. `InputError` when the
        template rewrites the text and a text holds one (`PromptEncoder.chat_text`)."""
        return self.prompts.chat_text(messages, add_generation_prompt=add_generation_prompt,
                                      enable_thinking=enable_thinking, **template_kwargs)

    def __call__(self, text: str | ChatText | list[str | ChatText], images: list[np.ndarray] | None = None,
                 videos: list[VideoClip] | None = None) -> dict[str, np.ndarray]:
        """Model inputs for one prompt (str) or a batch of prompts (list[str]); see the module docstring."""
        texts = _texts(text)  # checked before any pixel work
        media = self.encode_media(images, videos)
        texts_out = self.encode_text(texts, media)
        return {"input_ids": texts_out["input_ids"], "attention_mask": texts_out["attention_mask"],
                "mm_token_type_ids": texts_out["mm_token_type_ids"], **media.arrays,
                "position_ids": texts_out["position_ids"], "rope_deltas": texts_out["rope_deltas"]}

    def encode_media(self, images: list[np.ndarray] | None = None, videos: list[VideoClip] | None = None, *,
                     uint8: bool = False, frames: bool = False) -> MediaInputs:
        """The prompt-independent half of `__call__`: pixels, grids and placeholder sizes of the media.

        Several prompts about the same media (`encode_text` each) share one `encode_media`.
        uint8: pixel values as the resized uint8 levels (see the module docstring).
        frames: one media only; its pixel values are the resized uint8 frames `[F, h, w, 3]`
        (the pipeline ships these; the patch layout is made on the model's device).
        """
        arrays: dict[str, np.ndarray] = {}
        img_tokens: list[int] = []
        vid_parts: list[tuple[int, tuple[float, ...]]] = []
        if images:
            batch = process_images(list(images), self.image_config, self._lut(self.image_config.norm), uint8=uint8,
                                   frames=frames)
            arrays["pixel_values"], arrays["image_grid_thw"] = batch.pixel_values, batch.grid_thw
            merge2 = self.image_config.merge_size ** 2  # the reference counts with the processor's merge size
            img_tokens = [int(g.prod()) // merge2 for g in batch.grid_thw]
        if videos:
            batch = process_videos(list(videos), self.video_config, self._lut(self.video_config.norm), uint8=uint8,
                                   frames=frames)
            arrays["pixel_values_videos"], arrays["video_grid_thw"] = batch.pixel_values, batch.grid_thw
            merge2 = self.video_config.merge_size ** 2
            vid_parts = [(int(g[1] * g[2]) // merge2, ts)
                         for g, ts in zip(batch.grid_thw, batch.timestamps, strict=True)]
        return MediaInputs(arrays, tuple(img_tokens), tuple(vid_parts))

    def plan_media(self, plan: VideoPlan) -> tuple[tuple[int, int], MediaInputs]:
        """`encode_media(videos=[clip], frames=True)` of the clip `plan` will decode to, before it is
        decoded: its resized (h, w) and the `MediaInputs` (`video_grid_thw`, placeholder sizes;
        `pixel_values_videos` empty) that `encode_text` places the same tokens and positions with."""
        size, batch = plan_video(plan, self.video_config)
        merge2 = self.video_config.merge_size ** 2
        parts = tuple((int(g[1] * g[2]) // merge2, ts) for g, ts in zip(batch.grid_thw, batch.timestamps, strict=True))
        return size, MediaInputs({"pixel_values_videos": batch.pixel_values, "video_grid_thw": batch.grid_thw},
                                 (), parts)

    def encode_text(self, text: str | ChatText | list[str | ChatText], media: MediaInputs) -> dict[str, np.ndarray]:
        """The prompt half of `__call__`: `input_ids`, `attention_mask`, `mm_token_type_ids` [B, L],
        `position_ids` [3, B, L] and `rope_deltas` [B] of `text` over `media` (`encode_media`)."""
        rows = self.prompts.encode(_texts(text), list(media.image_tokens), list(media.video_parts))
        ids, mask = pad_batch(rows, self.prompts.tokens.pad, self.tokenizer.padding_side)
        types = np.zeros_like(ids)
        types[ids == self.prompts.tokens.image_pad] = 1
        types[ids == self.prompts.tokens.video_pad] = 2
        types[mask == 0] = 0
        positions, deltas = mrope_position_ids(
            types, media.arrays.get("image_grid_thw"), media.arrays.get("video_grid_thw"), mask,
            spatial_merge_size=self.spatial_merge_size)
        return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": types,
                "position_ids": positions, "rope_deltas": deltas}


def _texts(text: str | ChatText | list[str | ChatText]) -> list[str | ChatText]:
    """One prompt or a batch of prompts -> a non-empty list of prompts (else InputError); a prompt is
    a rendered string (tokenised whole, as the reference does) or a `ChatText` (`chat_text`)."""
    texts = [text] if isinstance(text, (str, ChatText)) else list(text)
    if not texts or not all(isinstance(t, (str, ChatText)) for t in texts):
        raise InputError("text must be a prompt string or a non-empty list of prompt strings")
    return texts
