"""The modes' collectives are marked for `--compile` without importing Dynamo into every run
(`h3core.model.compile_regions`): marking imports nothing, compiling turns the marks into
`torch.compiler.disable` (a graph break at each marked call), and an uncompiled call is the function's."""

from __future__ import annotations

import torch
from commands import fresh_python


def test_a_run_that_does_not_compile_imports_no_dynamo():
    code = (
        "import sys; import h3core.generate.run, h3core.parallel.modes.ulysses, h3core.parallel.modes.tensor;"
        "from h3core.model.compiled import compile_seconds_so_far; assert compile_seconds_so_far() == 0.0;"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    )
    assert fresh_python(code).strip() == "[]"


def test_a_marked_call_breaks_the_graph_once_compiling_starts_and_is_the_function_otherwise():
    from torch._dynamo.testing import CompileCounter

    from h3core.model.compile_regions import disable_marked, outside_compiled

    @outside_compiled
    def exchange(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    x = torch.arange(4.0)
    assert torch.equal(exchange(x), x * 3) and exchange.__name__ == "exchange"

    def step(x: torch.Tensor) -> torch.Tensor:
        return exchange(x + 1) - 1

    torch._dynamo.reset()
    disable_marked()
    counter = CompileCounter()
    assert torch.equal(torch.compile(step, backend=counter)(x), (x + 1) * 3 - 1)
    assert counter.frame_count == 2  # the pieces before and after the marked call: it ran outside the graph
