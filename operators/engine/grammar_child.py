"""The grammar compiler's child process (`python -m vlbatch.operators.engine.grammar_child`), started by
`grammar_compile.ChildCompiler`, which kills it at a compile's deadline.

Wire (stdin / stdout, one JSON object per line, never pickle):
- parent: {"tokenizer": {"info": TokenizerInfo JSON} | {"dir": ..., "vocab_size": V, "stop_ids": [...]} | null}
- child:  {"ready": true} once xgrammar is imported and the compiler made, or {"ready": false, "error": ...}
- then per format, parent: {"kind": ..., "spec": ...}; child: {"compiled": CompiledGrammar JSON | null
  (tokenizer-free: the grammar is built, nothing compiled), "error": the refusal's message | null}.
End of stdin ends it; it dies with its parent (Linux: PR_SET_PDEATHSIG). Its stdout is the wire only:
what libraries print goes to stderr.
"""
from __future__ import annotations

import json
import os
import signal
import sys


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _compiler(setup: dict | None):
    """The xgrammar compiler for `setup` (the wire's tokenizer), None when tokenizer-free."""
    if not setup:
        return None
    import xgrammar as xgr

    from vlbatch.operators.engine.grammar import tokenizer_info

    if "info" in setup:
        info = xgr.TokenizerInfo.deserialize_json(setup["info"])
    else:
        from vlbatch.operators.preprocess.tokenizer import load_tokenizer

        tok = load_tokenizer(setup["dir"])
        info = tokenizer_info(tok, int(setup["vocab_size"]), tuple(int(i) for i in setup["stop_ids"]))
    return xgr.GrammarCompiler(info, cache_enabled=False)


def _answer(compiler, request: dict) -> dict:
    from vlbatch.operators.engine.grammar import compile_problem, grammar_source
    from vlbatch.operators.engine.request import ResponseFormat
    from vlbatch.operators.errors import InputError

    try:
        fmt = ResponseFormat(request["kind"], request["spec"])
        grammar = grammar_source(fmt)
        if compiler is None:
            return {"compiled": None, "error": None}
        try:
            compiled = compiler.compile_grammar(grammar)
        except RuntimeError as e:
            return {"compiled": None, "error": compile_problem(fmt, e)}
        return {"compiled": compiled.serialize_json(), "error": None}
    except InputError as e:
        return {"compiled": None, "error": str(e)}


def main() -> int:
    _die_with_parent()
    wire = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr, never into the wire
    try:
        import xgrammar  # noqa: F401 - the slow import, before "ready"

        compiler = _compiler(json.loads(sys.stdin.readline() or "{}").get("tokenizer"))
    except Exception as e:  # noqa: BLE001 - the parent reports it (EngineError)
        wire.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        wire.flush()
        return 1
    wire.write(json.dumps({"ready": True}) + "\n")
    wire.flush()
    for line in sys.stdin:
        wire.write(json.dumps(_answer(compiler, json.loads(line))) + "\n")
        wire.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
