"""What an `h3 generate` run needs per rank, estimated from its plan, and the check before any rank starts.

This formula is the fallback of the memory model: on a CUDA run the dry run of the ranks' own code
decides whether each GPU holds its rank (`h3core.generate.dryrun.command.check_device_memory`), and
this formula checks the GPU only where no dry run can run or one did not finish (the run's
`MemoryCheck` says which); it always checks the host's memory and, on the CPU, the ranks' share of it.

A lower bound (`h3core.runtime.limits`): what is counted, per rank (the largest one), in the compute dtype
unless said otherwise:

- `weights`: the bytes the rank holds (the plan's `weights.per_rank`: all of them in Ulysses mode,
  its shards in tensor mode), 16-bit dense tensors at the compute dtype's width;
- `latents`: the seeded noise of the whole latent and its patchified copy, float32 (every rank
  draws the same noise, whatever the world size);
- `rope`: the RoPE table of the whole packed sequence (cos and sin of the rotated channels, float32)
  and its float64 positions;
- `activations`: the larger of one block's attention and MLP working set: Ulysses holds its own
  rows at the residual width plus q|k|v (attention width) and the output of its heads over the
  whole sequence; tensor mode all-gathers the whole sequence at the residual width and projects it
  to its shard;
- `attention scores`: the [heads, S, S] scores and their softmax, where the attention call
  materialises them (`h3core.model.attention.scores_bytes`);
- `steps`: the sigma schedule (computed in float64) and the per-step timings, per step;
- `process`: a spawned rank's own process (`h3core.runtime.limits.PROCESS_BYTES`);
- `adapters`: the LoRA branches of the request's adapters on the largest rank (h3core.lora.plan:
  whole in Ulysses mode, cut like their linears in tensor mode).

The longest of the run's sequences (prompt, negative prompt) sets the activations (with CFG
parallel a rank runs one of them, and the largest rank is one that runs the longest). Every group
of the run's layout runs the same plan, so the largest rank of one group is the largest of all.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from h3core import settings
from h3core.model.attention import scores_bytes
from h3core.model.config import ModelConfig
from h3core.parallel.modes import mode_of
from h3core.parallel.plan import ParallelPlan
from h3core.runtime.limits import PROCESS_BYTES, MemoryNeed, capacity, check_cpu_ranks, check_memory

if TYPE_CHECKING:
    import torch

STEP_BYTES = 56  # float64 arange, t and sigmas while the schedule is computed (24), a float and its list slot per timing (32)


class MemoryCheck(BaseModel):
    """How a run's device memory was checked before its ranks started: by the dry run of the ranks'
    own code (the memory model, `h3core.generate.dryrun`), or by this module's formula, its fallback."""

    model: Literal["dry run", "formula", "off"] = Field(description="What decided: the dry run of the ranks' code, the formula (its fallback), or nothing (H3_MEMORY_CHECK=0).")
    line: str = Field(description="One line: what was checked, against what, and why the formula decided where it did.")
    failed: bool = Field(False, description="A dry run was tried and did not finish (its one line is in `line`); the formula decided.")
    peak_bytes: int | None = Field(None, description="The largest rank's device peak: the dry run's prediction, or the formula's lower bound.")


def check_limits(config: ModelConfig, plan: ParallelPlan, latent_elements: int, steps: int, device: str, dtype: "torch.dtype", attention: str,
                 adapter_bytes: int = 0, *, host_part: bool = True, device_part: bool = True, gpu_bytes: int | None = None) -> MemoryNeed:
    """Refuse (one line) a run whose ranks this machine cannot start or hold (`h3core.runtime.limits`);
    returns the need. `device_part=False`: leave the GPU's part to the dry run (`resolve` on CUDA);
    `host_part=False`: only the GPU's part (the dry run's fallback); `gpu_bytes`: a GPU's usable bytes
    (default: this machine's); `adapter_bytes`: the LoRA branches the largest rank holds (h3core.lora.plan)."""
    launched = settings.under_torchrun()
    ranks = settings.ranks_on_this_machine(plan.layout.world_size)  # this machine's ranks, of every group
    if device != "cuda" and not launched and host_part:
        check_cpu_ranks(ranks)
    spawned = ranks > 1 and not launched
    need = generate_need(config, plan, latent_elements, steps, device, dtype, attention, spawned, ranks, adapter_bytes=adapter_bytes)
    have = capacity(device, ranks)
    if gpu_bytes is not None:
        have = replace(have, gpu_bytes=[gpu_bytes] * ranks)
    check_memory(need, have, "--width/--height/--frames", host_part=host_part, device_part=device_part)
    return need


def check_encode_memory(keyframes, request, config: ModelConfig, world_size: int) -> None:  # type: ignore[no-untyped-def]
    """Refuse (one line) keyframes rank 0 cannot encode before the denoiser loads: the video VAE's encoder
    or the vision tower (`h3core.generate.keyframes.encode_phase_bytes`) on its device."""
    from h3core.generate.keyframes import encode_phase_bytes

    on_device = encode_phase_bytes(keyframes, request.text_encoder_path, config.text_dim)
    need = MemoryNeed(ranks=1, device=request.device, on_device=on_device, on_host={}, spawned=False)
    check_memory(need, capacity(request.device, settings.ranks_on_this_machine(world_size)), "smaller keyframes (--width/--height)")


def generate_need(config: ModelConfig, plan: ParallelPlan, latent_elements: int, steps: int,
                  device: str, dtype: "torch.dtype", attention: str, spawned: bool, ranks: int | None = None, adapter_bytes: int = 0) -> MemoryNeed:
    """A generate run's need per rank (module docstring); `latent_elements`: video + audio latent
    elements; `ranks`: the ranks on this machine (default: every rank of the run); `adapter_bytes`:
    the LoRA branches of the largest rank."""
    s = max(seq.num_tokens for seq in plan.sequences)
    h_loc = max(plan.heads)
    on_device = {
        "weights": held_weight_bytes(plan, dtype.itemsize),
        "decoded weights": max(plan.decoded.bytes_per_rank) if plan.decoded is not None and plan.decoded.held and plan.decoded.bytes_per_rank else 0,
        "activations": activation_elements(config, plan, s) * dtype.itemsize,
        "attention scores": scores_bytes(attention, device, dtype, h_loc, s, config.head_dim),
        "rope": s * config.rotary_dim * 4 + s * 3 * 8,
        **({"adapters": adapter_bytes} if adapter_bytes else {}),
    }
    on_host = {"latents": 2 * latent_elements * 4, "steps": steps * STEP_BYTES}
    if spawned:
        on_host["process"] = PROCESS_BYTES
    return MemoryNeed(ranks=ranks or plan.layout.world_size, device=device, on_device=on_device, on_host=on_host, spawned=spawned)


def run_device_bytes(run) -> int:  # type: ignore[no-untyped-def]
    """One rank's estimated device bytes for `run` (a `ResolvedRun`; the largest rank): what a held pipeline keeps
    beside a decode on the same GPU (`h3 generate --prompts`)."""
    from h3core.runtime.device import compute_dtype

    req, shape = run.request, run.shape
    adapters = max((sum(r.bytes_per_rank[i] for r in run.adapters) for i in range(len(run.plan.ranks))), default=0)
    need = generate_need(run.config, run.plan, shape.latent_elements, shape.steps, req.device, compute_dtype(req.device, req.dtype), req.attention,
                         spawned=False, adapter_bytes=adapters)
    return sum(need.on_device.values())


def held_weight_bytes(plan: ParallelPlan, dtype_bytes: int) -> int:
    """The largest rank's weights: its stored bytes, 16-bit dense tensors at the compute dtype."""
    weights = plan.weights
    assert weights is not None, "ParallelPlan.build counts the weights"
    dense16 = weights.dense16_per_rank or [0] * len(weights.per_rank)
    return max(held + d16 // 2 * max(0, dtype_bytes - 2) for held, d16 in zip(weights.per_rank, dense16))


def activation_elements(config: ModelConfig, plan: ParallelPlan, s: int) -> int:
    """Elements of the larger of one block's attention and MLP working sets on the largest rank
    (`s`: tokens of the longest sequence): the plan's mode says (`ParallelMode.activation_elements`)."""
    return mode_of(plan.mode).activation_elements(config, plan.block_shape(s))


# --- Hopper's decoded weights, and the dry run's prediction ------------------------------------------


def plan_decoded_weights(plan: ParallelPlan, config: ModelConfig, choice: str, nvfp4_prefixes: list[str], *, capability: tuple[int, int] | None,
                         gpu_bytes: int | None, latent_elements: int, steps: int, dtype: "torch.dtype", attention: str,
                         host_bytes: int | None = None) -> ParallelPlan:
    """`plan` with its `decoded` record (`h3core.parallel.decoded`): `choice` 'auto' / 'on' / 'off' for a
    GPU of `capability` and `gpu_bytes` usable against the formula's need per rank, or (`capability`
    None) for the CPU, every rank of this machine against `host_bytes` available."""
    from h3core.nvfp4.matmul import FP4_MIN_CAPABILITY, PATH_CPU_DEQUANT, PATH_CUDA_BF16
    from h3core.parallel.decoded import GPU_ELEMENT_BYTES, choose, decoded_weights

    if capability is not None:
        cost = decoded_weights(config, plan, nvfp4_prefixes, held=False, reason="", element_bytes=GPU_ELEMENT_BYTES)
        need = generate_need(config, plan, latent_elements, steps, "cuda", dtype, attention, spawned=False)
        decodes = PATH_CUDA_BF16 if tuple(capability) < FP4_MIN_CAPABILITY else None
        held, why = choose(choice, decodes=decodes, need_bytes=sum(need.on_device.values()), room_bytes=gpu_bytes,
                           cost_bytes=max(cost.bytes_per_rank, default=0))
    else:
        cost = decoded_weights(config, plan, nvfp4_prefixes, held=False, reason="", element_bytes=dtype.itemsize)
        ranks = settings.ranks_on_this_machine(plan.layout.world_size)
        need = generate_need(config, plan, latent_elements, steps, "cpu", dtype, attention, spawned=ranks > 1, ranks=ranks)
        decodes = None if settings.emulate_fp4() else PATH_CPU_DEQUANT
        held, why = choose(choice, decodes=decodes, need_bytes=need.host_total(), room_bytes=host_bytes,
                           cost_bytes=ranks * max(cost.bytes_per_rank, default=0), room="the host")
    return plan.model_copy(update={"decoded": cost.model_copy(update={"held": held, "reason": why})})
