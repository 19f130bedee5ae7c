"""The decode step with static shapes: padded to a batch bucket, replayed as a CUDA graph.

A step in which every sequence decodes one generated token (no prompt rows, no media)
runs on fixed buffers of a (batch bucket, context-width bucket) key instead of fresh
tensors: batch B is padded to the smallest bucket `Bp >= B` of `buckets` (1, 2, 4, ...),
the context to `W` blocks, W a power of two (the buffers hold block tables [Bp, W] and
lengths; the gather + SDPA path derives `W * bs` masked context slots per row from them on
the device, inside the graph; a paged kernel reads only each row's own length). Padded rows
decode token 0 at position 0 over one context slot of the KV tensor's scratch block (its
last, never handed out by the `BlockManager`), and read and write the `StatePool`'s
scratch slot, so they corrupt nothing and need no host decisions.

On CUDA each key's forward is captured once as a `torch.cuda.CUDAGraph` (all keys share one
memory pool) and replayed: the step then costs one launch, and filling the buffers is
non-blocking copies from pinned memory (the host never waits on the device before
reading the sampled tokens). Elsewhere, or when a capture fails (an op that syncs), the
same padded forward runs eagerly, so CPU tests exercise exactly the buffers a graph
would read. Steps with prompt chunks, or more sequences than the largest bucket, take
the runner's eager path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vlbatch.operators.engine.runner.step_cache import PagedStepCache
from vlbatch.operators.engine.scheduling.scheduler import StepPlan
from vlbatch.operators.kernels.attention.layout import PagedLayout, padded_tables

log = logging.getLogger(__name__)


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= max_num_seqs."""
    out = [1]
    while out[-1] < max_num_seqs:
        out.append(out[-1] * 2)
    return tuple(out)


@dataclass(frozen=True)
class StaticBuffers:
    """The fixed inputs of one (Bp, W) key (device tensors, overwritten in place each step)."""

    input_ids: torch.Tensor  # [Bp] long
    positions: torch.Tensor  # [3, Bp] long
    slot_mapping: torch.Tensor  # [Bp] long: where each row's new K/V goes
    rows: torch.Tensor  # [Bp] long: 0..Bp-1 (decode rows and logits rows)
    tables: torch.Tensor  # [Bp, W] int32
    lens: torch.Tensor  # [Bp] int32
    state_slots: torch.Tensor  # [Bp] long: DeltaNet pool slot of each row

    @classmethod
    def empty(cls, bp: int, width: int, device) -> StaticBuffers:
        long = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(bp, **long), torch.zeros(3, bp, **long), torch.zeros(bp, **long),
                   torch.arange(bp, **long), torch.zeros(bp, width, dtype=torch.int32, device=device),
                   torch.ones(bp, dtype=torch.int32, device=device), torch.zeros(bp, **long))

    def fill(self, host: dict[str, torch.Tensor]) -> None:
        """Copy a step's host tensors (same names and shapes) in, without blocking the host."""
        cuda = self.input_ids.device.type == "cuda"
        for name, src in host.items():
            getattr(self, name).copy_(src.pin_memory() if cuda else src, non_blocking=cuda)


@dataclass
class _Entry:
    bufs: StaticBuffers
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [Bp, V]: the graph's output


class StaticDecode:
    """Runs decode-only steps of a `ModelRunner` on static buffers (see the module docstring)."""

    def __init__(self, runner, buckets: tuple[int, ...], use_graphs: bool | None = None):
        self.runner, self.buckets = runner, tuple(sorted(buckets))
        self.use_graphs = runner.device.type == "cuda" if use_graphs is None else use_graphs
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._pool = None  # the graphs' shared memory pool, made at the first capture
        self.replays = 0  # steps served by a graph (the rest ran the padded forward eagerly)

    def accepts(self, plan: StepPlan) -> bool:
        """Every chunk one generated token (past its prompt) that samples; B within the buckets."""
        return (0 < len(plan.chunks) <= self.buckets[-1]
                and all(c.end - c.start == 1 and c.start >= c.seq.prompt_len and c.sample for c in plan.chunks))

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [B, V] (float32) of the plan's B decodes, in plan order."""
        chunks, bs = plan.chunks, self.runner.block_size
        b = len(chunks)
        bp = next(n for n in self.buckets if n >= b)
        blocks = max(-(-c.end // bs) for c in chunks)
        width = 1 << (blocks - 1).bit_length()
        entry = self._entries.get((bp, width)) or self._make(bp, width)
        host, layout_chunks = self._host_inputs(chunks, bp, width)
        entry.bufs.fill(host)
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
            logits = entry.logits
        else:
            logits = self._forward(entry.bufs, layout_chunks)
        return logits[:b].float()

    # -- inputs ------------------------------------------------------------------------------
    def _host_inputs(self, chunks, bp: int, width: int) -> tuple[dict[str, torch.Tensor], tuple]:
        """The padded host tensors of a step (names of `StaticBuffers`) and the layout's chunks."""
        bs, pad = self.runner.block_size, bp - len(chunks)
        scratch = self.runner.scratch_block
        tables = [c.seq.block_table[: -(-c.end // bs)] for c in chunks] + [[scratch]] * pad
        lens = [c.end for c in chunks] + [1] * pad
        pos = [c.start + c.seq.request.rope_delta for c in chunks] + [0] * pad
        host = {"input_ids": torch.tensor([c.seq.token_ids[c.start] for c in chunks] + [0] * pad),
                "positions": torch.tensor(pos)[None].expand(3, -1).contiguous(),
                "slot_mapping": torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens,
                                                                                                    strict=True)]),
                "tables": padded_tables(tables, width),
                "lens": torch.tensor(lens, dtype=torch.int32),
                "state_slots": torch.tensor([c.seq.slot for c in chunks] + [self.runner.pool.scratch_slot] * pad)}
        return host, tuple((i, n - 1, t) for i, (t, n) in enumerate(zip(tables, lens, strict=True)))

    def _padding_inputs(self, bp: int, width: int) -> tuple[dict[str, torch.Tensor], tuple]:
        """Every row a padded row: what the buffers hold while a graph is warmed up and captured."""
        return self._host_inputs((), bp, width)

    # -- forward -----------------------------------------------------------------------------
    def _forward(self, bufs: StaticBuffers, layout_chunks: tuple) -> torch.Tensor:
        """[Bp, V] logits of the buffers' rows (model dtype); only ops that never sync."""
        r = self.runner
        layout = PagedLayout(bufs.slot_mapping, bufs.rows, (), layout_chunks, r.block_size, bufs.tables, bufs.lens,
                             bufs.tables.shape[1] * r.block_size)
        cache = PagedStepCache(r.kv, r.pool, layout, (1,) * bufs.rows.numel(), bufs.state_slots, r.attention)
        return r.model.forward_packed(r.model.embed(bufs.input_ids), bufs.positions, cache, bufs.rows)

    def _make(self, bp: int, width: int) -> _Entry:
        entry = _Entry(StaticBuffers.empty(bp, width, self.runner.device))
        self._entries[(bp, width)] = entry
        if self.use_graphs:
            try:
                self._capture(entry, bp, width)
            except RuntimeError as exc:  # an op that cannot be captured: this key runs eagerly
                log.warning("CUDA graph capture of decode bucket (%d, %d) failed, running it eagerly: %s",
                            bp, width, exc)
                entry.graph, entry.logits = None, None
        return entry

    def _capture(self, entry: _Entry, bp: int, width: int) -> None:
        """Warm up on a side stream, then capture; the buffers hold only padded rows meanwhile,
        so the warm-up runs write the scratch block and slot alone."""
        host, layout_chunks = self._padding_inputs(bp, width)
        entry.bufs.fill(host)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(entry.bufs, layout_chunks)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry.logits = self._forward(entry.bufs, layout_chunks)
        entry.graph = graph
