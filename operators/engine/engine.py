"""`Engine`: the public entry point. Requests in, results out as each finishes.

The request path (nano-vllm style): `generate` keys every prompt for the prefix cache,
plans the branch points shared between prompts, queues them; then each step the
`Scheduler` picks chunks, the `ModelRunner` computes logits, the scheduler commits
(snapshots at branch points), the sampler picks tokens, and finished requests are
yielded immediately (no whole-batch barrier).

Budgets (bytes): `kv_budget_bytes` sizes the paged KV pool of the full-attention layers
(blocks held by the prefix cache live in it too, and are evicted before anything is
preempted); `prefix_cache_bytes` bounds what the radix tree keeps (DeltaNet snapshots +
the distinct KV blocks it references; 0 turns the prefix cache off);
`vision_cache_bytes` bounds cached vision features (0 turns it off). DeltaNet slots:
`max_num_seqs` of them (`state_bytes_per_seq` each). `operators/factory.load_engine(memory_fraction=...)`
sizes the KV pool and prefix cache from free device memory instead (`caches/memory.py`).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict

import torch

from vlbatch.operators.engine.caches import PREFIX_CACHES
from vlbatch.operators.engine.caches.block_manager import BlockManager, blocks_for_budget, kv_bytes_per_block
from vlbatch.operators.engine.caches.prefix_cache import KeyCodec, NoPrefixCache
from vlbatch.operators.engine.caches.vision_cache import LRUVisionCache, NoVisionCache
from vlbatch.operators.engine.config import EngineConfig
from vlbatch.operators.engine.grammar import GrammarBook, parse_answer
from vlbatch.operators.engine.grammar_compile import GrammarBudget
from vlbatch.operators.engine.request import Request, Result, Timings, split_thinking
from vlbatch.operators.engine.runner.model_runner import ModelRunner
from vlbatch.operators.engine.sampler import make_generator, sample
from vlbatch.operators.engine.scheduling.prefix_planner import PrefixPlanner
from vlbatch.operators.engine.scheduling.scheduler import Scheduler
from vlbatch.operators.engine.scheduling.sequence import Sequence
from vlbatch.operators.errors import EngineError, InputError, VlbatchError
from vlbatch.operators.kernels.attention import select_attention

COMPILE_POLL_S = 0.1  # a step with nothing but requests waiting for their grammar waits this long at most


class Engine:
    def __init__(self, model, tokenizer, eos_ids: tuple[int, ...], config: EngineConfig):
        text = model.config.text
        self.model, self.tokenizer, self.eos_ids, self.config = model, tokenizer, eos_ids, config
        elem = torch.empty(0, dtype=model.dtype).element_size()
        block_bytes = kv_bytes_per_block(config.block_size, len(text.full_layers), text.num_key_value_heads,
                                         text.head_dim, elem)
        num_blocks = blocks_for_budget(config.kv_budget_bytes, block_bytes)
        self.blocks = BlockManager(num_blocks, config.block_size)
        vcache = LRUVisionCache(config.vision_cache_bytes) if config.vision_cache_bytes > 0 else NoVisionCache()
        self.runner = self._runner(model, num_blocks, vcache)
        store = PREFIX_CACHES.load(config.prefix_cache)  # where prefixes are stored (caches/__init__.py)
        share = config.prefix_cache_bytes > 0
        self.planner = PrefixPlanner(config.block_size, share=share)
        self.prefix_cache = (store(self.blocks, block_bytes, config.prefix_cache_bytes, self.planner.expects)
                             if share else NoPrefixCache())
        self.scheduler = Scheduler(self.blocks, self.runner.pool, self.prefix_cache, self.planner,
                                   max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   chunk_size=config.chunk_size)
        self.codec = KeyCodec()
        # constrained decoding: each format compiled once, off this thread, under the grammar budget; a
        # constrained request waits in `compiling` (not yet in the scheduler) until its format is compiled
        self.grammars = GrammarBook(tokenizer, text.vocab_size, eos_ids,
                                    GrammarBudget(config.grammar_compile_s, config.grammar_max_bytes))
        self.compiling: list[Sequence] = []

    def _runner(self, model, num_blocks: int, vcache) -> ModelRunner:
        """The model runner over `num_blocks` KV blocks (a tensor-parallel leader builds its own)."""
        c = self.config
        return ModelRunner(model, num_blocks, c.block_size, c.max_num_seqs, vcache,
                           select_attention(c.attention, model.device),
                           static_decode=c.static_decode)

    # -- stats ----------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token

    @property
    def state_bytes_per_seq(self) -> int:
        return self.runner.pool.bytes_per_slot

    def stats(self) -> dict:
        out = {**asdict(self.runner.stats), **asdict(self.scheduler.stats)}
        return {**out, **self.prefix_cache.stats(), **self.runner.vision_cache.stats(),
                "grammar_compilations": self.grammars.compilations}

    # -- generation -----------------------------------------------------------------------
    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Run every request; yield each `Result` as soon as its request finishes.

        Requests of one call are planned together (shared prefixes found, siblings held
        back until the first has cached the prefix). Bad requests yield an error result.
        """
        yield from self.submit(requests)
        try:
            while self.has_work:
                yield from self.step()
        finally:
            self.abort()

    @property
    def has_work(self) -> bool:
        """Whether submitted requests are still running or waiting (for the scheduler or their grammar)."""
        return self.scheduler.has_work or bool(self.compiling)

    @property
    def num_waiting(self) -> int:
        """Submitted requests not yet admitted to the running batch."""
        return len(self.scheduler.waiting) + len(self.compiling)

    def submit(self, requests: Iterable[Request]) -> list[Result]:
        """Queue requests beside those already running (the incremental half of `generate`:
        a long-lived caller submits batches as they arrive and keeps calling `step`, so the
        continuous batch never drains between them). The requests of one call are planned
        together as in `generate`. Returns the error results of requests rejected now."""
        t0 = time.perf_counter()
        rejected: list[Result] = []
        reqs = _group_adjacent(list(requests))
        keys = [self.codec.encode(r.prompt_token_ids, r.media) for r in reqs]
        plans = self.planner.branch_points(reqs, keys)
        for r, k, bp in zip(reqs, keys, plans, strict=False):
            seq = Sequence(r, k, bp, make_generator(r.sampling, "cpu"), arrival=t0)
            problem = self._check(seq)
            if problem:
                rejected.append(self._error(seq, problem))
            elif seq.request.response_format is not None:  # scheduled once its format is compiled
                self.grammars.start(seq.request.response_format)
                self.compiling.append(seq)
            else:
                self.scheduler.add(seq)
        return rejected + self._admit_compiled()

    def step(self) -> list[Result]:
        """One scheduler step over everything submitted; the results that finished in it."""
        return list(self._step())

    def abort(self) -> None:
        """Drop every submitted request (after a failed `step`: the caller reports them)."""
        self.scheduler.abort_all()
        self.compiling.clear()

    def _check(self, seq: Sequence) -> str | None:
        merge2 = self.runner.merge ** 2
        for m in seq.request.media:
            t, h, w = m.grid_thw
            if m.num_tokens * merge2 != t * h * w:
                return (f"{m.kind} grid {m.grid_thw} needs {t * h * w // merge2} placeholders, "
                        f"the prompt has {m.num_tokens}")
        if max(seq.request.prompt_token_ids) >= self.model.config.text.vocab_size:
            return "prompt token id beyond the vocabulary"
        if not self.scheduler.fits_at_all(seq):
            return (f"prompt ({seq.prompt_len}) + max_new_tokens ({seq.request.sampling.max_new_tokens}) "
                    f"exceeds the KV pool ({self.blocks.num_blocks * self.blocks.block_size} tokens)")
        return None

    def _stops(self, seq: Sequence) -> tuple[int, ...]:
        sp = seq.request.sampling
        return sp.stop_token_ids if sp.stop_token_ids is not None else self.eos_ids

    def _admit_compiled(self) -> list[Result]:
        """Requests whose format is compiled go to the scheduler (in their order) with their matcher; those
        whose format failed (refused, over the grammar budget) are error results, naming their question."""
        out, held = [], []
        for seq in self.compiling:
            job = self.grammars.start(seq.request.response_format)
            if not job.done():
                held.append(seq)
            elif job.exception() is not None:
                out.append(self._grammar_error(seq, job.exception()))
            else:
                seq.grammar = self.grammars.state(seq.request.response_format, self._stops(seq),
                                                  seq.request.thinking)
                self.scheduler.add(seq)
        self.compiling = held
        return out

    def _grammar_error(self, seq: Sequence, exc: BaseException) -> Result:
        name = seq.request.response_format.name
        message = f"question {name!r}: {exc}" if name else str(exc)
        kind = type(exc).__name__ if isinstance(exc, VlbatchError) else "EngineError"
        now = time.perf_counter() - seq.arrival
        return Result.failed(seq.request, message, kind, Timings(now, now, now))

    def _step(self) -> Iterator[Result]:
        yield from self._admit_compiled()
        if not self.scheduler.has_work:
            if self.compiling:  # only requests waiting for their grammar: wait a moment for a compile
                self.grammars.wait(COMPILE_POLL_S)
            return
        plan = self.scheduler.schedule()
        for seq, msg in self.scheduler.failed:
            yield self._error(seq, msg)
        self.scheduler.failed.clear()
        if not plan.chunks:
            if self.scheduler.has_work:
                raise EngineError("scheduler made no progress")  # a bug, never a budget problem
            return
        try:
            logits = self.runner.run(plan)
        except InputError as exc:
            for c in plan.chunks:  # roll the step back: every sequence recomputes from its cache hit
                self.scheduler.preempt(c.seq)
            raise EngineError(f"step failed: {exc}") from exc
        self.scheduler.commit(plan)
        picked = [c for c in plan.chunks if c.sample]
        if not picked:
            return
        params = [c.seq.request.sampling for c in picked]
        hist = [torch.tensor(c.seq.token_ids) if c.seq.request.sampling.repetition_penalty else None for c in picked]
        logits = self.grammars.mask_logits(logits, [c.seq.grammar for c in picked])  # constrained rows only
        tokens = sample(logits, params, hist, [c.seq.generator for c in picked])
        now = time.perf_counter()
        for c, tok in zip(picked, tokens, strict=False):
            seq = c.seq
            seq.token_ids.append(tok)
            if seq.grammar is not None:
                seq.grammar.accept(tok)
            seq.t_first = seq.t_first or now
            reason = self._finish_reason(seq, tok)
            if reason:
                self.scheduler.finish(seq)
                yield self._result(seq, reason)

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        sp = seq.request.sampling
        stops = self._stops(seq)
        if tok in stops:
            return "stop"
        # a grammar that ended (or, with no stop token to end it, reached a whole value) finishes the request
        if seq.grammar is not None and (seq.grammar.terminated or (not stops and seq.grammar.complete)):
            return "stop"
        if sp.stop_strings:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            if any(s in text for s in sp.stop_strings):
                return "stop"
        if len(seq.token_ids) - seq.prompt_len >= sp.max_new_tokens:  # (not len(output_ids): a copy per step)
            return "length"
        return None

    # -- results --------------------------------------------------------------------------
    def _result(self, seq: Sequence, reason: str) -> Result:
        req = seq.request
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in req.sampling.stop_strings if s in text]
        if cuts:
            text = text[: min(cuts)]
        thinking = None
        if req.thinking:
            thinking, text = split_thinking(text)
        now = time.perf_counter()
        timings = Timings(queued_s=(seq.t_admitted or now) - seq.arrival,
                          first_token_s=(seq.t_first or now) - seq.arrival, total_s=now - seq.arrival)
        parsed, truncated = None, False
        if seq.grammar is not None:  # a whole value parsed, else truncated (never a half-parsed value)
            truncated = not seq.grammar.complete
            parsed = None if truncated else parse_answer(req.response_format, text)
        return Result(id=req.id, token_ids=tuple(seq.output_ids), text=text, thinking=thinking,
                      finish_reason=reason, prompt_tokens=seq.prompt_len, visual_tokens=req.visual_tokens,
                      generated_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens, timings=timings,
                      parsed=parsed, truncated=truncated)

    def _error(self, seq: Sequence, message: str) -> Result:
        now = time.perf_counter() - seq.arrival
        return Result.failed(seq.request, message, "InputError", Timings(now, now, now))


def _group_adjacent(reqs: list[Request]) -> list[Request]:
    """Stable order in which requests sharing a `group` follow the group's first request."""
    first: dict[str, int] = {}
    keyed = []
    for i, r in enumerate(reqs):
        k = first.setdefault(r.group, i) if r.group is not None else i
        keyed.append((k, i))
    return [reqs[i] for _, i in sorted(keyed)]
