"""No weight decoded twice on the CPU (issue 34.7): `--decoded-weights auto` holds the NVFP4 linears
decoded once, in the stream dtype, where the host has room for every rank's copy; the plan carries
the decision, the bytes and the reason, and the latents are bitwise those of decoding per forward."""

from __future__ import annotations

import pytest
import torch

from h3core.generate.memory import plan_decoded_weights
from h3core.generate.request import GenerateRequest, resolve
from h3core.model.config import preset
from h3core.model.synthetic import synthetic_specs
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan

TINY = preset("tiny")
PREFIXES = sorted({s.prefix for s in synthetic_specs(TINY) if s.name.endswith(".weight_scale")})


def _decide(mode: Mode, ranks: int, host_bytes: int | None, dtype: torch.dtype = torch.float32, choice: str = "auto"):
    plan = ParallelPlan.for_preset("tiny", ranks, mode)
    return plan_decoded_weights(plan, TINY, choice, PREFIXES, capability=None, gpu_bytes=None, latent_elements=1000, steps=4,
                                dtype=dtype, attention="sdpa", host_bytes=host_bytes).decoded


def _elements(prefixes: list[str]) -> int:
    """Weights of those linears, from the model's own slots (out x in each)."""
    from h3core.model.checkpoint import linear_slots
    from h3core.model.dit import H3Model

    slots = dict(linear_slots(H3Model(TINY)))
    return sum(slots[p].out_features * slots[p].in_features for p in prefixes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_holds_them_on_the_cpu_in_the_stream_dtype_where_the_host_has_room(dtype):
    held = _decide(Mode.ULYSSES, 2, host_bytes=64 << 30, dtype=dtype)
    assert held.held and held.count == len(PREFIXES) and "cpu-dequant decodes every forward" in held.reason
    assert held.bytes_per_rank == [_elements(PREFIXES) * dtype.itemsize] * 2  # Ulysses ranks: every weight whole
    tensor = _decide(Mode.TENSOR, 2, host_bytes=64 << 30, dtype=dtype)
    assert tensor.held and sum(tensor.bytes_per_rank) == held.bytes_per_rank[0]  # tensor ranks: their shards


def test_auto_leaves_them_where_the_host_lacks_room_or_nothing_is_decoded(monkeypatch):
    cost = _decide(Mode.ULYSSES, 2, host_bytes=64 << 30).bytes_per_rank[0]
    tight = _decide(Mode.ULYSSES, 2, host_bytes=cost)  # one rank's copy fits, the machine's two do not
    assert not tight.held and "do not fit" in tight.reason and tight.bytes_per_rank == [cost, cost]
    assert not _decide(Mode.ULYSSES, 1, host_bytes=None).held  # the host's memory unknown
    assert _decide(Mode.ULYSSES, 1, host_bytes=None, choice="on").held
    assert not _decide(Mode.ULYSSES, 1, host_bytes=64 << 30, choice="off").held
    monkeypatch.setenv("H3_EMULATE_FP4", "1")  # the fp4 path: codes are read, never decoded
    emulated = _decide(Mode.ULYSSES, 1, host_bytes=64 << 30)
    assert not emulated.held and "fp4 GEMM" in emulated.reason


def test_a_cpu_run_holds_them_by_default_with_the_bits_of_decoding_every_forward():
    from h3core.generate.run import execute

    runs = [resolve(GenerateRequest(steps=2, decoded_weights=choice)) for choice in ("auto", "off")]
    assert [r.plan.decoded.held for r in runs] == [True, False]
    (auto,), (off,) = (execute(r) for r in runs)
    assert auto.weights.resident - off.weights.resident == runs[0].plan.decoded.bytes_per_rank[0]
    assert all(torch.equal(auto.latents[k], off.latents[k]) for k in ("video", "audio"))
