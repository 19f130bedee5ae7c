"""The job config's number types: every number field of every section is one of these.

- `Int`: an integer, strictly: `true`, `"10"` and `10.0` are refused (never coerced).
- `Float`: a finite number, strictly: `.inf`, `-.inf` and `.nan` are refused, and so are `true` and `"10"`
  (PyYAML reads `1e300`, without a dot, as a string); a YAML integer is its whole value (`window_s: 6`).

Each field states its range with `Field(ge/gt, le)` beside its description (a float always has an upper
bound: `1.0e+300` is refused by it), so the range is in ``configs/job.schema.json`` too.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import AllowInfNan, Strict

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]

DAY_S = 86400.0  # the longest duration any `*_s` field takes (a timeout, an interval)
