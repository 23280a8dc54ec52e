"""Limits before work: what a run needs per rank, estimated from its plan, against what the machine has.

An estimate here is a *lower bound*: the sum of tensors a rank must hold at the same time, taken
from the run's plan (tokens per rank, heads per rank, widths, blocks, steps), plus what a rank
process costs before it does anything. A run whose lower bound does not fit cannot succeed, so it
is refused in one line before any rank starts and before any tensor is allocated (a request for
100000x100000 pixels used to allocate for 15 s and die with "can't allocate memory").

What is counted, per rank (the largest one), in the compute dtype unless said otherwise:

- `weights`: the bytes the rank holds (`checkpoint.weight_bytes`: all of them in Ulysses mode,
  its shards in tensor mode), dense tensors at the compute dtype's width;
- `latents`: the seeded noise of the whole latent and its patchified copy, float32 (every rank
  draws the same noise, whatever the world size);
- `rope`: the RoPE table of the whole packed sequence (cos and sin, float32);
- `activations`: the larger of one block's attention and MLP working set: Ulysses holds its own
  rows at model width plus q|k|v and the output of its heads over the whole sequence; tensor mode
  all-gathers the whole sequence at model width and projects it to its shard;
- `attention scores`: the [heads, S, S] scores and their softmax, when the attention call
  materialises them: the `math` backend always; `sdpa` when PyTorch's dispatcher picks its math
  kernel for inputs laid out as `attention._sdpa` passes them (`attention.planned_sdpa_kernel`;
  with the 4-D views it passes, the CPU takes flash); never the fused kernels (flash, memory-efficient, cuDNN, SageAttention).
  Decided without touching CUDA: on a GPU `sdpa` is taken as fused;
- `steps`: the sigma schedule (computed in float64) and the per-step timings, per step;
- `process`: a spawned rank's own process (Python, torch, Gloo): measured at ~147 MiB of
  anonymous memory on Linux before any work; 128 MiB is counted.

On a CPU every rank's need comes out of one pool (`MemAvailable`, or the cgroup's limit when
lower). On CUDA each rank's device part must fit its GPU (total memory less a CUDA context) and
the host parts of all ranks the host. `H3_MEMORY_CHECK=0` skips the check (an estimate can be
wrong about a machine with swap); `H3_MAX_CPU_RANKS` raises the cap on Gloo ranks per machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from h3core.environment import env_bool, env_int
from h3core.errors import ResourceLimit

if TYPE_CHECKING:
    import torch

    from h3core.config import ModelConfig
    from h3core.plan import ParallelPlan

MEMORY_CHECK_ENV = "H3_MEMORY_CHECK"
MAX_CPU_RANKS_ENV = "H3_MAX_CPU_RANKS"
MAX_CPU_RANKS = 64
"""Gloo ranks one machine runs by default: 56 (H3's heads) with room; each is a process with its own torch."""

PROCESS_BYTES = 128 << 20
STEP_BYTES = 56  # float64 arange, t and sigmas while the schedule is computed (24), a float and its list slot per timing (32)
CUDA_CONTEXT_BYTES = 256 << 20  # lower bound of what the CUDA context and NCCL take from each GPU


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one rank needs (the largest rank), by part, split by where they live."""

    ranks: int
    device: str  # "cpu" | "cuda"
    on_device: dict[str, int] = field(default_factory=dict)  # on the rank's compute device
    on_host: dict[str, int] = field(default_factory=dict)  # in host memory whatever the device
    spawned: bool = True  # ranks are new processes (False: one rank in this process)

    def host_total(self) -> int:
        """Host bytes of all ranks together (on a CPU the device parts are host memory too)."""
        per_rank = sum(self.on_host.values()) + (sum(self.on_device.values()) if self.device == "cpu" else 0)
        return self.ranks * per_rank

    def parts(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for name, n in [*self.on_device.items(), *self.on_host.items()]:
            merged[name] = merged.get(name, 0) + n
        return dict(sorted(merged.items(), key=lambda item: -item[1]))

    def describe(self) -> str:
        return ", ".join(f"{name} {_size(n)}" for name, n in self.parts().items() if n)


# --- estimates -------------------------------------------------------------------------------------


def scores_bytes(attention: str, device: str, dtype: "torch.dtype", heads: int, tokens: int, head_dim: int) -> int:
    """Bytes of the attention scores one call holds at once (0 for kernels that never materialise them)."""
    import torch

    from h3core.attention import planned_sdpa_kernel

    if attention == "math":
        return 2 * 4 * heads * tokens * tokens  # h3's reference: float32 scores and softmax
    if attention != "sdpa" or device == "cuda":
        return 0
    kernel = planned_sdpa_kernel(torch.device("cpu"), dtype, heads, head_dim)
    return 2 * dtype.itemsize * heads * tokens * tokens if kernel == "sdpa:math" else 0


def generate_need(config: "ModelConfig", plans: "list[ParallelPlan]", latent_elements: int, steps: int,
                  device: str, dtype: "torch.dtype", attention: str, spawned: bool) -> MemoryNeed:
    """A generate run's need per rank: `plans` are the partitions of its sequences (prompt, and
    guidance's negative prompt), `latent_elements` the video + audio latent elements."""
    from h3core.checkpoint import weight_bytes
    from h3core.plan import Mode

    dtype_bytes = dtype.itemsize
    plan = max(plans, key=lambda p: p.num_tokens)
    weights = weight_bytes(config, plan)
    dense = weights.checkpoint_bytes - weights.nvfp4_bytes  # stored as bf16, held at the compute dtype
    held = max(weights.per_rank) + dense * max(0, dtype_bytes - 2) // 2
    s, s_loc, h_loc, n = plan.num_tokens, max(plan.tokens), max(plan.heads), plan.world_size
    d, dh, f = config.hidden, config.head_dim, config.mlp_width
    x = s_loc * d  # the residual stream rows, alive through the block
    if plan.mode is Mode.TENSOR:
        gathered = s * d if n > 1 else 0  # the all-gathered sequence (one rank: the identity, no copy)
        attn = x + gathered + s * 3 * h_loc * dh + s * h_loc * dh  # + q|k|v of its heads, their output
        mlp = x + gathered + s * 3 * -(-f // n)  # + its FC1 rows' output [S, 2F/N] and activation [S, F/N]
    else:
        received = s * 3 * h_loc * dh if n > 1 else 0  # q|k|v of its heads over the whole sequence (one rank: the identity)
        attn = x + s_loc * 3 * d + received + s * h_loc * dh  # + its q|k|v rows, the attention output
        mlp = x + s_loc * 3 * f  # + FC1 output [S_loc, 2F] and activation [S_loc, F]
    on_device = {
        "weights": held,
        "activations": max(attn, mlp) * dtype_bytes,
        "attention scores": scores_bytes(attention, device, dtype, h_loc, s, dh),
        "rope": s * dh * 4,
    }
    on_host = {"latents": 2 * latent_elements * 4, "steps": steps * STEP_BYTES}
    if spawned:
        on_host["process"] = PROCESS_BYTES
    return MemoryNeed(ranks=plan.world_size, device=device, on_device=on_device, on_host=on_host, spawned=spawned)


def transport_need(tokens: int, heads: int, head_dim: int, world_size: int, device: str, dtype: "torch.dtype",
                   attention: str | None) -> MemoryNeed:
    """`h3 bench-transport`'s need per rank: q|k|v rows, their head-sharded copy, the output and the
    baseline's buffers (and attention's scores with the `math` backend)."""
    s_loc, h_loc = -(-tokens // world_size), -(-heads // world_size)
    rows = 2 * s_loc * 3 * heads * head_dim  # q|k|v and the send side of seq->head
    by_head = 2 * tokens * 3 * h_loc * head_dim  # received q|k|v and the baseline's receive buffer
    outputs = 2 * tokens * h_loc * head_dim  # the attention output (or its stand-in) and head->seq
    scores = scores_bytes(attention, device, dtype, h_loc, tokens, head_dim) if attention else 0
    on_device = {"activations": (rows + by_head + outputs) * dtype.itemsize, "attention scores": scores}
    on_host = {"process": PROCESS_BYTES} if world_size > 1 else {}
    return MemoryNeed(ranks=world_size, device=device, on_device=on_device, on_host=on_host, spawned=world_size > 1)


# --- what the machine has --------------------------------------------------------------------------


@dataclass(frozen=True)
class Capacity:
    """Memory a run may use: host bytes available now, and each GPU's usable bytes (CUDA)."""

    host_bytes: int | None  # None: unknown (no /proc): the host check is skipped
    host_source: str
    gpu_bytes: list[int] = field(default_factory=list)


def host_available() -> tuple[int | None, str]:
    """(bytes, where the figure comes from): `MemAvailable`, or the cgroup's remaining limit if lower."""
    available, source = None, ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available, source = int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError):
        pass
    cgroup = _cgroup_remaining()
    if cgroup is not None and (available is None or cgroup < available):
        available, source = cgroup, "the cgroup's memory.max"
    return available, source


def _cgroup_remaining() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def capacity(device: str, ranks: int) -> Capacity:
    """What this machine offers a run of `ranks` ranks on `device` (no CUDA context is created)."""
    host, source = host_available()
    gpus: list[int] = []
    if device == "cuda":
        import torch

        gpus = [torch.cuda.get_device_properties(i).total_memory - CUDA_CONTEXT_BYTES for i in range(min(ranks, torch.cuda.device_count()))]
    return Capacity(host_bytes=host, host_source=source, gpu_bytes=gpus)


# --- the checks ------------------------------------------------------------------------------------


def check_memory(need: MemoryNeed, have: Capacity, what: str) -> None:
    """Raise `ResourceLimit` (one line, exit 2) when `need` cannot fit `have`; no-op when
    `H3_MEMORY_CHECK=0`. `what` names the run's knobs for the advice ('--width/--height/--frames')."""
    if env_bool(MEMORY_CHECK_ENV) is False:
        return
    skip = f"{MEMORY_CHECK_ENV}=0 skips this check"
    if need.device == "cuda" and have.gpu_bytes:
        per_gpu = sum(need.on_device.values())
        smallest = min(have.gpu_bytes)
        if per_gpu > smallest:
            raise ResourceLimit(
                f"this run needs at least {_size(per_gpu)} of GPU memory per rank ({_device_parts(need)}) but a GPU here "
                f"has {_size(smallest)} usable; {_advice(need, what)}; {skip}"
            )
    host = need.host_total()
    if have.host_bytes is not None and host > have.host_bytes:
        ranks = f" ({need.ranks} ranks x {_size(host // need.ranks)})" if need.ranks > 1 else ""
        raise ResourceLimit(
            f"this run needs at least {_size(host)} of memory{ranks}: {need.describe()} per rank; "
            f"this machine has {_size(have.host_bytes)} available ({have.host_source}); {_advice(need, what)}; {skip}"
        )


def _device_parts(need: MemoryNeed) -> str:
    return ", ".join(f"{name} {_size(n)}" for name, n in sorted(need.on_device.items(), key=lambda item: -item[1]) if n)


def _advice(need: MemoryNeed, what: str) -> str:
    largest = next(iter(need.parts()))
    if largest == "steps":
        return "use fewer --steps"
    if largest == "process":
        return "use fewer ranks"
    if largest == "weights":
        return "use tensor mode or more GPUs, so that each holds a share of the weights"
    return f"use a smaller {what}" + (" or more ranks" if need.device == "cuda" else "")


def max_cpu_ranks() -> int:
    value = env_int(MAX_CPU_RANKS_ENV)
    return value if value is not None and value > 0 else MAX_CPU_RANKS


def check_cpu_ranks(world_size: int) -> None:
    """A CPU run is `world_size` processes on one machine; more than `H3_MAX_CPU_RANKS` (64) is refused."""
    cap = max_cpu_ranks()
    if world_size > cap:
        raise ResourceLimit(
            f"{world_size} CPU ranks asked for, but h3 starts at most {cap} Gloo ranks on one machine (each is a "
            f"process with its own torch, about {_size(world_size * PROCESS_BYTES)} for {world_size} before any work); "
            f"use at most {cap}, or set {MAX_CPU_RANKS_ENV}={world_size} to allow more"
        )
