"""Load a checkpoint directory into `Qwen35Model`: config.json + safetensors (one file or sharded).

The model is built on the meta device (no memory), every checkpoint tensor is checked
against it before anything is read (missing, unexpected and mis-shaped tensors are
all listed in one `CheckpointError`), then each parameter is read from the
memory-mapped file (`safetensors.safe_open`), cast to the requested dtype and device
and put in place: one tensor at a time, so RAM never holds a second full copy. On CPU
in the checkpoint's own dtype nothing is copied at all: parameters stay views of the
file's private (copy-on-write) mapping and pages are read on first use.

Names: checkpoint `model.visual.*` / `model.language_model.*` map to the model's
`visual.*` / `language_model.*`; `lm_head.weight` to `lm_head.weight` (a tied
checkpoint has none, and one present there is ignored). MoE experts are accepted
either stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) or per expert
(`mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`, what `save_pretrained` and the
released checkpoints write). `mtp.*` tensors (multi-token prediction head) are loaded
into `model.mtp_weights` unchanged in name. Last, `fuse_projections` concatenates the
projections that share an input (the parameters become views of the fused weights, so
names and values stay those of the checkpoint).
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from vlbatch.operators.errors import ConfigError
from vlbatch.operators.model.architectures import build_model
from vlbatch.operators.model.config import ModelConfig
from vlbatch.operators.model.model import Qwen35Model
from vlbatch.operators.storage.named_file import checkpoint_text
from vlbatch.operators.storage.names import printable, relative_name_problem

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # the names configs use


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or its name in `DTYPES` ("float32", "bfloat16", "float16"); ConfigError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}")
    return DTYPES[dtype]


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ConfigError):
    """The checkpoint's tensors do not match its config.json (names the tensors)."""


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: parameter `param`, optionally the slice `index` of it."""

    param: str
    index: tuple | None = None


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Checkpoint tensor name -> safetensors file holding it."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(checkpoint_text(index)).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map is not a mapping of tensor names to shard files")
        for shard in sorted(set(weight_map.values()), key=str):  # untrusted: never joined unchecked
            if (why := relative_name_problem(shard)) is not None:
                raise CheckpointError(f"{index} names the shard {printable(str(shard))!r}, which {why}; shard "
                                      "names must be files inside the checkpoint folder")
        missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        return {name: root / f for name, f in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {root}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def check_checkpoint(model_dir: str | Path) -> None:
    """What `load_model` checks before reading a weight, alone: config.json parses, the weights
    are safetensors, and every tensor's name and shape matches the model config.json describes
    (from the files' headers; no weight is read). Raises ConfigError / CheckpointError."""
    config = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in build_model(config).named_parameters()}
    _plan(checkpoint_files(model_dir), shapes, config)


class Layout(Protocol):
    """How a model is laid out over ranks; `operators/parallel/shard.RankShard` is the one
    implementation (the loader stays below `parallel/`: it never imports it)."""

    def build(self, config: ModelConfig) -> Qwen35Model:
        """This rank's model, built on the meta device (full shapes when unsharded)."""

    def slice(self, name: str, shape: tuple[int, ...], text) -> object | None:
        """This rank's part of checkpoint tensor `name` of full `shape` (None: the whole)."""


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               delta_rule: str = "auto", moe: str = "auto", layout: Layout | None = None) -> Qwen35Model:
    """Read config.json and the safetensors weights of `model_dir` -> eval-mode `Qwen35Model`.
    `delta_rule`: a name of `operators/kernels/delta_rule.DELTA_RULE`; `moe` (MoE
    checkpoints): a name of `operators/kernels/moe.MOE`. With `layout` (a rank of a tensor-parallel
    replica: `operators/parallel/shard.RankShard`), this rank's shard: only its slices of each tensor
    are read from the memory-mapped files."""
    from vlbatch.operators.kernels.delta_rule import select_delta_rule
    from vlbatch.operators.kernels.moe import MOE, select_experts

    kernels = select_delta_rule(device, delta_rule)  # a bad choice fails before the weights load
    MOE.entry(moe)
    config = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = build_model(config)  # full shapes (its family's class): what the checkpoint must match
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if layout is not None:
            model = layout.build(config)
    files = checkpoint_files(model_dir)
    plan, mtp = _plan(files, shapes, config)
    shard_of = (lambda name: layout.slice(name, shapes[name], config.text)) if layout is not None else None
    _materialise(model, plan, files, torch.device(device), dtype, shard_of)
    for name in mtp:
        with safe_open(str(files[name]), framework="pt") as f:
            model.mtp_weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    model = model.eval().requires_grad_(False).fuse_projections().use_delta_kernels(kernels)
    if torch.device(device).type == "cpu" and torch_dtype(dtype) == torch.float32:  # where the CPU ops apply
        from vlbatch.operators.model.ops.warm_up import warm_up_cpu

        warm_up_cpu()
    text = model.config.text
    if text.is_moe:
        model.use_experts(select_experts(device, dtype, text.hidden_size, text.moe_intermediate_size, moe))
    return model


def _target(name: str, config: ModelConfig) -> _Target | None:
    """The parameter a checkpoint tensor fills, or None when the name is not ours."""
    if name == "lm_head.weight":
        return _Target("lm_head.weight")
    if not name.startswith("model."):
        return None
    local = name[len("model.") :]
    m = _EXPERT.match(local)
    if m:
        prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
        inner = config.text.moe_intermediate_size or 0
        if part == "down_proj":
            return _Target(f"{prefix}.down_proj", (e,))
        rows = slice(0, inner) if part == "gate_proj" else slice(inner, 2 * inner)
        return _Target(f"{prefix}.gate_up_proj", (e, rows))
    return _Target(local)


def _slice_shape(shape: tuple[int, ...], index: tuple | None) -> tuple[int, ...]:
    if index is None:
        return shape
    return tuple(torch.empty(shape, device="meta")[index].shape)


def _plan(files: dict[str, Path], shapes: dict[str, tuple], config: ModelConfig):
    """Check names and shapes; -> ({param: [(ckpt name, index)]}, [mtp names]). Raises CheckpointError."""
    plan: dict[str, list[tuple[str, tuple | None]]] = defaultdict(list)
    unexpected, mismatched, mtp = [], [], []
    handles: dict[Path, object] = {}
    try:
        for name, path in files.items():
            if name.startswith("mtp."):
                mtp.append(name)
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the head is the embedding
            target = _target(name, config)
            if target is None or target.param not in shapes:
                unexpected.append(name)
                continue
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt")
            got = tuple(handles[path].get_slice(name).get_shape())
            want = _slice_shape(shapes[target.param], target.index)
            if got != want:
                mismatched.append(f"{name}: checkpoint {list(got)}, model expects {list(want)}")
                continue
            plan[target.param].append((name, target.index))
    finally:
        handles.clear()
    missing = [p for p in shapes if not _covered(p, plan.get(p, []), shapes[p])]
    problems = []
    if missing:
        problems.append(f"missing tensors: {sorted(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {sorted(unexpected)}")
    if mismatched:
        problems.append("mis-shaped tensors: " + "; ".join(sorted(mismatched)))
    if problems:
        raise CheckpointError("checkpoint does not match config.json: " + " | ".join(problems))
    return dict(plan), mtp


def _covered(param: str, parts: list, shape: tuple) -> bool:
    """A parameter is complete from one whole tensor, or from every expert slice."""
    if any(index is None for _, index in parts):
        return True
    if not parts:
        return False
    need = shape[0] * (2 if param.endswith("gate_up_proj") else 1)
    return len({(idx[0], str(idx[1:])) for _, idx in parts}) == need


def _materialise(model: nn.Module, plan: dict, files: dict[str, Path], device: torch.device, dtype: torch.dtype,
                 shard_of=None):
    """Replace every meta parameter by its loaded tensor (one parameter in memory at a time).
    `shard_of(param) -> Shard | None` (`operators/parallel/plan.py`): read only that part."""
    handles: dict[Path, object] = {}

    def read(name: str, shard) -> torch.Tensor:
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        if shard is None:
            return handles[path].get_tensor(name)
        sl = handles[path].get_slice(name)
        lead = (slice(None),) * shard.dim
        return torch.cat([sl[(*lead, slice(a, b))] for a, b in shard.ranges], dim=shard.dim)

    for param, parts in plan.items():
        module_name, _, attr = param.rpartition(".")
        module = model.get_submodule(module_name)
        shape = getattr(module, attr).shape
        shard = shard_of(param) if shard_of is not None else None
        whole = [n for n, idx in parts if idx is None]
        if whole:
            value = read(whole[0], shard).to(device=device, dtype=dtype)
        else:
            value = torch.empty(shape, device=device, dtype=dtype)
            for name, index in parts:
                for local, part_shard in _local_parts(index, shard):
                    value[local] = read(name, part_shard).to(device=device, dtype=dtype)
        setattr(module, attr, nn.Parameter(value.contiguous(), requires_grad=False))
    handles.clear()


def _local_parts(index: tuple, shard) -> list[tuple[tuple, object]]:
    """A per-expert tensor filling `full[index]` (index (e,) or (e, rows)) -> the
    [(index into the rank's tensor, part of the checkpoint tensor to read)] it contributes."""
    if shard is None:
        return [(index, None)]
    if shard.dim == 0:  # expert parallel: whole experts [a, b)
        a, b = shard.ranges[0]
        return [((index[0] - a, *index[1:]), None)] if a <= index[0] < b else []
    if len(index) == 1:  # the tensor spans the sharded dim whole (dim - 1 in the tensor)
        return [(index, type(shard)(shard.dim - 1, shard.ranges))]
    s0, s1 = index[1].start, index[1].stop  # gate or up rows of gate_up, sharded on dim 1
    out, off = [], 0
    for a, b in shard.ranges:
        lo, hi = max(a, s0), min(b, s1)
        if lo < hi:
            out.append(((index[0], slice(off + lo - a, off + hi - a)), type(shard)(0, ((lo - s0, hi - s0),))))
        off += b - a
    return out
