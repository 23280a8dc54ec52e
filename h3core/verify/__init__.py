"""`h3 verify`: every distributed piece of h3 compared with its single-rank reference, with the error.

Checks (`CHECK_NAMES`, in run order): transport, sdpa, ragged, projection, tp, nvfp4, parity,
backends. Each runs the engine's real code (collectives, `UlyssesProcessor`, `apply_tensor`, the
NVFP4 shard functions and reader, `rank_generate`) on one World spawned once and reused for every
check and every rank count (sub-groups via `RankContext.first_ranks`), and reports one
`CheckRow` per variant and count. `verify(VerifyConfig(...)) -> VerifyReport` is the entry point;
the modules:

- `spec`     what was asked (`VerifyConfig`) and what ranks need (`VerifySpec`); torch-free
- `rows`     `Measure` (one rank's comparison), `CheckRow`, `VerifyReport`; torch-free
- `session`  the shared World: checks at a count, single-rank jobs side by side; `Check`
- `transport`, `layers`, `nvfp4_layout`, `end_to_end`  the checks; `checks` their registry
- `runner`   `verify()`: validate, spawn once, run, write the report

This package's `__init__` imports nothing heavy: the CLI validates names and counts first.
"""

from h3core.verify.rows import CheckRow, Measure, VerifyReport
from h3core.verify.spec import CHECK_NAMES, VerifyConfig, VerifySpec, parse_checks

__all__ = ["CHECK_NAMES", "CheckRow", "Measure", "VerifyConfig", "VerifyReport", "VerifySpec", "parse_checks"]
