"""Constrained decoding: a request's `ResponseFormat` as an xgrammar grammar, a matcher per sequence.

Why xgrammar (not llguidance; vLLM ships both): it is what vLLM, SGLang and TensorRT-LLM use by
default, it compiles a JSON Schema / regex / EBNF once per tokenizer into a grammar whose per-token
masks are mostly precomputed (a decode step's mask costs microseconds per row), and it applies the
packed bitmask to torch logits in one call on the CPU (its own C++ kernel) as well as on CUDA
(Triton), which our CPU-first engine needs. llguidance computes masks lazily per step (more
flexible grammars, no precompilation) and its torch apply path is CUDA-first.

Per engine: one `GrammarBook`: each distinct format (its `key`) compiled once, off the engine loop's
thread (one daemon compile thread, in a child process killed at the budget's deadline:
`grammar_compile.py`); `start(fmt)` hands back the compile's `Future` (a second request for the format
gets the same one, never a second compile), the engine holds the format's requests until it is done
while the others decode; `compilations` counts the compiled grammars.
Per sequence: one `GrammarState` (an xgrammar `GrammarMatcher` whose stop tokens are the request's).
Per step: `mask_logits` fills one bitmask `[n, ceil(V / 32)]` int32 for the constrained rows only
and applies it to the logits `[n, V]` in one call; a batch with no constrained row costs nothing.
Thinking: a thinking request's grammar starts after the `</think>` token (`GrammarState.active`).
Only generated tokens reach a matcher, so chunked prefill, the prefix cache and recomputation after
preemption (the generated tokens are kept) never touch it; a tensor-parallel replica samples on rank 0
only (`operators/parallel/replica.py`), where the matchers live.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import torch

from vlbatch.operators.engine.grammar_compile import ChildCompiler, GrammarBudget, size_problem
from vlbatch.operators.engine.request import ResponseFormat
from vlbatch.operators.errors import InputError

THINK_END = "</think>"
CHILD_IDLE_S = 5.0  # the compile child is stopped after this long without a format to compile


def grammar_source(fmt: ResponseFormat):
    """The tokenizer-free xgrammar `Grammar` of `fmt`; InputError naming what xgrammar refuses."""
    import xgrammar as xgr

    try:
        if fmt.kind == "json_schema":
            return xgr.Grammar.from_json_schema(fmt.spec, any_whitespace=False, strict_mode=True)
        if fmt.kind == "regex":
            return xgr.Grammar.from_regex(fmt.spec)
        if fmt.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(fmt.spec)))
    except (RuntimeError, ValueError) as e:
        raise InputError(f"the {fmt.kind} response format is refused by the grammar engine: "
                         f"{_last_line(e)}") from None
    raise InputError(f"unknown response format type {fmt.kind!r} (json_schema, choice, regex)")


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: exactly one of the choices (JSON string escapes are EBNF's)."""
    if not choices:
        raise InputError("a choice response format needs at least one choice")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_problem(fmt: ResponseFormat, e: BaseException) -> str:
    """The message of a format xgrammar's compiler refuses."""
    return f"the {fmt.kind} response format cannot be compiled: {_last_line(e)}"


def _last_line(e: BaseException) -> str:
    """xgrammar's message without its `[time] file.cc:line:` prefix."""
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    head, sep, tail = text.partition(".cc:")
    return tail.split(":", 1)[-1].strip() if sep else text


def tokenizer_info(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """xgrammar's view of the checkpoint's vocabulary: our `Tokenizer` (a byte-level BPE in
    `tokenizer.backend`) or a transformers tokenizer. Added (control) tokens are special: an empty
    string, which no grammar ever allows (only the stop tokens end a value)."""
    import xgrammar as xgr

    backend = getattr(tokenizer, "backend", None)
    if backend is None:  # a transformers tokenizer (load_tokenizer's fallback)
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))
    vocab = [""] * vocab_size
    for text, i in backend.get_vocab(with_added_tokens=False).items():
        if i < vocab_size and i not in added:
            vocab[i] = text
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=list(stop_ids))


@dataclass
class GrammarState:
    """One sequence's matcher; `active` False until a thinking request's `</think>` is generated."""

    matcher: object  # xgrammar.GrammarMatcher
    active: bool
    think_end: int | None

    def accept(self, token: int) -> None:
        """Advance by the sampled token (before the grammar starts: watch for `</think>`)."""
        if not self.active:
            self.active = token == self.think_end
            return
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise InputError(f"token {token} is outside the grammar")  # the mask allowed it: a bug

    @property
    def complete(self) -> bool:
        """The value is whole: the matcher reached its end (a stop token accepted, or nothing
        else allowed)."""
        return self.active and (self.matcher.is_terminated() or self.matcher.is_completed())

    @property
    def terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()


@dataclass
class GrammarBook:
    """The engine's compiled grammars (one per distinct format, by `ResponseFormat.key`), compiled under
    `budget` by `compile_fn` (default `compile_in_child`) on one daemon thread (module docstring)."""

    tokenizer: object
    vocab_size: int
    stop_ids: tuple[int, ...]
    budget: GrammarBudget = field(default_factory=GrammarBudget)
    compile_fn: Callable[[ResponseFormat], object] | None = None  # fmt -> xgrammar CompiledGrammar
    compilations: int = 0
    fill_s: float = 0.0  # seconds filling bitmasks (the matchers' CPU work), over the engine's life
    apply_s: float = 0.0  # seconds applying them to the logits
    _info: object = None  # xgrammar TokenizerInfo of the checkpoint's vocabulary
    _child: ChildCompiler | None = None
    _jobs: dict = field(default_factory=dict)  # format key -> its compile's Future
    _queue: queue.Queue = field(default_factory=queue.Queue)
    _worker: threading.Thread | None = None
    _bitmask: torch.Tensor | None = None

    def start(self, fmt: ResponseFormat) -> Future:
        """The compile of `fmt` (started now unless it was before): its result the compiled grammar, its
        exception an InputError (refused, over the budget) or EngineError (the compiler could not start)."""
        job = self._jobs.get(fmt.key)
        if job is not None:
            return job
        job = self._jobs[fmt.key] = Future()
        if (why := size_problem(fmt, self.budget)) is not None:  # refused before anything compiles it
            job.set_exception(InputError(why))
            return job
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="grammar-compile", daemon=True)
            self._worker.start()
        self._queue.put((fmt, job))
        return job

    def wait(self, timeout: float) -> None:
        """Until a compile in flight finishes, or `timeout` seconds."""
        running = [j for j in self._jobs.values() if not j.done()]
        if running:
            wait(running, timeout=timeout, return_when=FIRST_COMPLETED)

    def compiled(self, fmt: ResponseFormat):
        """The compiled grammar of `fmt`, waiting for its compile (InputError when refused)."""
        return self.start(fmt).result()

    def compile_in_child(self, fmt: ResponseFormat):
        """`fmt` compiled in the killable child under `budget` (`grammar_compile.ChildCompiler`)."""
        import xgrammar as xgr

        info = self._tokenizer_info()
        if self._child is None:
            self._child = ChildCompiler({"info": info.serialize_json()}, self.budget)
        return xgr.CompiledGrammar.deserialize_json(self._child.compile(fmt), info)

    def close(self) -> None:
        """Stop the compile thread and kill the child (a compile in flight fails)."""
        self._queue.put((None, None))
        if self._child is not None:
            self._child.close()

    def _work(self) -> None:
        """The compile thread: one format at a time, in order; the child is stopped once no format came
        for `CHILD_IDLE_S` (formats come with the first requests: one child start for them all)."""
        while True:
            try:
                fmt, job = self._queue.get(timeout=CHILD_IDLE_S)
            except queue.Empty:
                if self._child is not None:
                    self._child.close()
                fmt, job = self._queue.get()
            if fmt is None:
                return
            try:
                out = (self.compile_fn or self.compile_in_child)(fmt)
            except Exception as e:  # noqa: BLE001 - the format's requests get it as their error
                job.set_exception(e)
                continue
            self.compilations += 1
            job.set_result(out)

    def _tokenizer_info(self):
        if self._info is None:
            self._info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
        return self._info

    def state(self, fmt: ResponseFormat, stop_ids: tuple[int, ...], thinking: bool) -> GrammarState:
        """A fresh matcher for one sequence; `stop_ids` end the value (the request's stop tokens). Waits
        for the format's compile (the engine calls it once `start(fmt)` is done)."""
        import xgrammar as xgr

        compiled = self.compiled(fmt)
        think_end = _token_id(self.tokenizer, THINK_END)
        # no stop token (stop_token_ids=()): xgrammar needs one to override with, so the value ends itself
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_ids) or None,
                                     terminate_without_stop_token=not stop_ids)
        return GrammarState(matcher, active=not thinking or think_end is None, think_end=think_end)

    def mask_logits(self, logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
        """logits [n, V'] (V' >= vocab_size) -> float32 logits with every token the grammar of row i
        forbids at -inf, for the rows whose state is active; the others untouched. One bitmask
        [n, ceil(V / 32)] filled on the CPU, one apply call on the logits' device. A step without a
        constrained row returns at once and never imports xgrammar (an unconstrained run needs none)."""
        rows = [i for i, s in enumerate(states) if s is not None and s.active and not s.matcher.is_terminated()]
        if not rows:
            return logits
        import xgrammar as xgr

        t0 = time.perf_counter()
        bitmask = self._mask_buffer(len(states))
        for i in rows:
            states[i].matcher.fill_next_token_bitmask(bitmask, i)
        t1 = time.perf_counter()
        logits = logits.float()
        if logits.shape[-1] > self.vocab_size:  # lm_head padding beyond the grammar's vocabulary: never allowed
            logits[rows, self.vocab_size:] = float("-inf")
        xgr.apply_token_bitmask_inplace(logits, bitmask[: len(states)].to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size, indices=rows)
        self.fill_s, self.apply_s = self.fill_s + t1 - t0, self.apply_s + time.perf_counter() - t1
        return logits

    def _mask_buffer(self, n: int) -> torch.Tensor:
        """The step's bitmask [>= n, ceil(V / 32)] int32, reused across steps (grown when a batch is larger)."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 8), self.vocab_size)
        return self._bitmask


def _token_id(tokenizer, text: str) -> int | None:
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        return backend.token_to_id(text)
    tid = tokenizer.convert_tokens_to_ids(text)
    return tid if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) else None


def parse_answer(fmt: ResponseFormat, text: str) -> str:
    """The validated value of a complete constrained answer as JSON text (`parsed` column):
    a JSON schema's value re-serialised, a choice or a regex match as a JSON string.
    InputError when the text is not a whole value (a bug upstream, never a half-parsed value)."""
    if fmt.kind == "json_schema":
        # strict=False: xgrammar 0.2.9's rule for a string with maxLength lets raw control characters
        # through (JSON wants them escaped); `parsed` escapes them
        try:
            value = json.loads(text, strict=False)
        except json.JSONDecodeError as e:
            raise InputError(f"the answer is not JSON: {e}") from None
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(text, ensure_ascii=False)
