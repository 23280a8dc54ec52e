"""The fp4 GEMM self-test of a CUDA run, before its ranks start (`h3core.nvfp4.selftest`).

A rank's NVFP4 linears take `cuda-fp4-scaled-mm` only where the self-test accepted the GPU's fp4
GEMM (SM120 fp4 GEMMs have returned zeros for particular M; nothing else would notice). Left to
the ranks, each would test a default shape set lazily at its first fp4 GEMM, from inside its own
CUDA context. Instead the launching process tests, before the World:

- the shapes the ranks will multiply: every fp4 GEMM (M, N, K) the dry run of their own code called
  (`h3core.generate.dryrun`, which a CUDA run makes anyway for its memory check), else (no dry run:
  `H3_MEMORY_CHECK=0`) the self-test's default set;
- on every GPU this machine's ranks use, each in its own child process, in parallel;

and the records travel to the ranks inside the resolved run (`ResolvedRun.fp4_selftest`), where
each takes its own GPU's verdict into its `DeviceKernels` (`rank_kernels`), which its loader gives
every NVFP4 linear. The run report carries
them, and each rank's report the shapes it really ran (`RankReport.fp4_gemm_shapes`):
`untested_shapes` names any the self-test did not cover. One test per process and set of shapes:
a parity reference or the next batch round reuses it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

from h3core import settings
from h3core.nvfp4.selftest import DEFAULT_SHAPES, FP4SelfTest, Shape

if TYPE_CHECKING:
    import torch

    from h3core.generate.request import ResolvedRun
    from h3core.nvfp4.kernels import DeviceKernels

_tested: dict[tuple[tuple[str, ...], tuple[Shape, ...]], dict[str, FP4SelfTest]] = {}
"""This machine's GPUs' self-tests by (GPUs, shapes): a fact of the machine the process runs on, meant
to be reused by every request of the process (a parity reference, the next batch round, a server's
next job); nothing of a request is in it."""


def needs_selftest(run: "ResolvedRun") -> bool:
    """A CUDA run whose checkpoint has NVFP4 linears, on a GPU with an fp4 GEMM (Blackwell on)."""
    import torch

    from h3core.nvfp4.matmul import FP4_MIN_CAPABILITY

    if run.request.device != "cuda" or not torch.cuda.is_available():
        return False
    if run.plan.decoded is None or not run.plan.decoded.count:  # the plan counts the checkpoint's NVFP4 linears
        return False
    return tuple(torch.cuda.get_device_capability(0)) >= FP4_MIN_CAPABILITY


def rank_devices(run: "ResolvedRun") -> list[str]:
    """The GPUs this machine's ranks of `run` compute on (`rank_device`: cuda:LOCAL_RANK)."""
    launched = settings.torchrun_env()
    if launched is not None:
        return [f"cuda:{launched.local_rank}"]
    return [f"cuda:{i}" for i in range(settings.ranks_on_this_machine(run.plan.layout.world_size))]


def with_fp4_selftest(run: "ResolvedRun", shapes: Sequence[Sequence[int]] | None = None) -> "ResolvedRun":
    """`run` carrying the self-test of each of its GPUs at `shapes` (None: the default set); `run`
    itself where no fp4 GEMM can be taken (CPU, no NVFP4 linears, a GPU before Blackwell)."""
    if run.fp4_selftest is not None or not needs_selftest(run):
        return run
    tested = tuple(sorted({(int(m), int(n), int(k)) for m, n, k in shapes})) if shapes else DEFAULT_SHAPES
    devices = tuple(rank_devices(run))
    key = (devices, tested)
    if key not in _tested:
        _tested[key] = _run_all(devices, tested)
    return run.model_copy(update={"fp4_selftest": _tested[key]})


def _run_all(devices: Sequence[str], shapes: Sequence[Shape]) -> dict[str, FP4SelfTest]:
    """Each device's self-test in its own child process, all at once (threads only wait on them)."""
    from h3core.nvfp4.selftest import run_fp4_selftest

    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        results = list(pool.map(lambda device: run_fp4_selftest(shapes, device), devices))
    return dict(zip(devices, results))


def rank_kernels(run: "ResolvedRun", device: "torch.device") -> "DeviceKernels":
    """On a rank: its device's `DeviceKernels`, whose fp4 GEMM verdict is the launcher's record for
    this rank's GPU where the run carries one (else its own self-test, run if an fp4 GEMM is asked for)."""
    from h3core.nvfp4.kernels import DeviceKernels

    record = run.fp4_selftest.get(str(device)) if run.fp4_selftest else None
    return DeviceKernels.of(device, record)


def untested_shapes(run: "ResolvedRun", ran: Sequence[Sequence[int]]) -> list[list[int]]:
    """The fp4 GEMM shapes a rank ran that its GPU's self-test did not check (none, when the dry run
    predicted the ranks' calls exactly)."""
    if not run.fp4_selftest:
        return [list(s) for s in ran]
    checked = {(c.m, c.n, c.k) for record in run.fp4_selftest.values() for c in record.checks}
    return [list(s) for s in ran if tuple(s) not in checked]
