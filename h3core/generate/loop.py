"""The denoising loop on one rank: the velocity of this rank's rows, guidance, the float32 Euler steps.

One forward per step serves both modalities at their own noise levels (`Clocks`: text and video rows
at the video schedule's t, audio rows at the audio schedule's, keyframe condition rows at
`max(t, 0.999)`); video and audio then step on their own schedules (`FlowMatchH3`, shift 12 and 3)
at the same index. Condition rows are inputs only: noised once before the loop, never stepped.

The latent state is this rank's rows of the prompt's sequence (`Latent`, float32) for the whole
loop. With guidance the negative prompt's sequence splits the same latent rows differently (its
text is another length): the rows are re-split to its partition for its forward and the velocity
back again (`repartition_rows`, one all-to-all each way; nothing moves where the splits agree).

With CFG parallel (`CfgHalf`) a rank runs one of the two sequences: branch 0 the prompt's, branch 1
the negative prompt's, each over its own group of ranks. Its latent state is its rows in its own
sequence's split; per step it computes its sequence's velocity for those rows, ONE exchange with the
other half (`exchange_halves`) brings the other branch's velocity for the same rows, and both halves
form the same guided velocity (same formula, same operand order as above) and the same float32
Euler update, so they hold the same latent values throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from h3core.generate.instruments import HostValues, on_host
from h3core.generate.profile import Profiler, step_context
from h3core.generate.cache import CacheRecord, SequenceCacheRecord
from h3core.generate.sequences import Latent, Sequence, latent_kinds
from h3core.model.dit import Clocks, H3Model
from h3core.model.sampler import FlowMatchH3, check_finite, guided_velocity
from h3core.model.step_cache import CachePolicy, FirstBlockCache
from h3core.model.sequence import AUDIO_CLOCK, CONDITION_CLOCK, CONDITION_LEVEL, VIDEO_CLOCK, SegmentKind
from h3core.parallel.collectives import exchange_halves, repartition_rows
from h3core.parallel.layout import CfgHalf
from h3core.parallel.runtime import ParallelRuntime
from h3core.runtime.device import DeviceMeter
from h3core.runtime.faults import maybe_inject_fault

StepDoneCallback = Callable[[int, int, float], None]
"""Called after every step with (step, steps, seconds)."""
StepGate = Callable[[int], bool]
"""Called before every step with its index on every rank of the request's group; True stops the
loop there (`StepsStopped`). It must answer the same on every rank of the group at the same step
(the serving engine's gate agrees by one collective: `h3core.serve.board`), or the group's
collectives would part ways."""


class StepsStopped(Exception):
    """The loop was stopped at a step boundary by its gate (a cancelled job): `step` steps ran."""

    def __init__(self, step: int):
        super().__init__(f"stopped before step {step + 1}")
        self.step = step


@dataclass
class Denoiser:
    """One request's loop state on one rank: the parallelized model, the runtime, the request's
    sequences (the prompt's first), guidance, the two schedules, with CFG parallel this rank's half,
    and where a step's clocks are computed (`host`: `h3core.generate.instruments`)."""

    model: H3Model
    runtime: ParallelRuntime
    sequences: list[Sequence]
    guidance_scale: float
    schedules: dict[SegmentKind, FlowMatchH3]
    cfg: CfgHalf | None = None
    host: HostValues = field(default=on_host)
    cache: CachePolicy = field(default_factory=CachePolicy)
    caches: dict[int, FirstBlockCache] = field(default_factory=dict)  # per sequence index, for this request

    def cache_of(self, index: int) -> FirstBlockCache | None:
        """Sequence `index`'s step cache (None: `--cache off`); its change is summed over the sequence's ranks."""
        if not self.cache.on:
            return None
        if index not in self.caches:
            self.caches[index] = FirstBlockCache(self.cache.threshold, self.runtime.sum_over_ranks)
        return self.caches[index]

    def cache_record(self) -> CacheRecord | None:
        """What the step cache did, per sequence (None: off)."""
        if not self.cache.on:
            return None
        return CacheRecord(policy=str(self.cache), steps=self.num_steps, sequences={
            self.sequences[i].plan.name: SequenceCacheRecord(skipped=c.skipped, changes=c.changes) for i, c in sorted(self.caches.items())})

    @property
    def num_steps(self) -> int:
        return self.schedules[SegmentKind.VIDEO].num_steps

    def clocks(self, index: int, device: torch.device) -> Clocks:
        """Step `index`'s timesteps on `device`: the video schedule's for text and video rows, the audio
        one's for audio rows, and with keyframes `max(video's, 0.999)` for their condition rows (as
        diffusers' plan: a float max); their distinct values are host arithmetic: `host`."""
        return self.host(self.host_clocks, index).to(device)

    def host_clocks(self, index: int) -> Clocks:
        """Step `index`'s clocks on the host, from the schedules' timesteps."""
        video = self.schedules[SegmentKind.VIDEO].timesteps[index]
        times = {VIDEO_CLOCK: video, AUDIO_CLOCK: self.schedules[SegmentKind.AUDIO].timesteps[index]}
        if any(seg.kind is SegmentKind.CONDITION for seg in self.sequences[0].segments):
            times[CONDITION_CLOCK] = max(float(video), CONDITION_LEVEL)
        return Clocks.of(times)

    @property
    def kinds(self) -> list[SegmentKind]:
        """The latent kinds of the request (video, audio), in order."""
        return latent_kinds(self.sequences[0].segments)

    @property
    def own(self) -> int:
        """The sequence whose split this rank's latent rows follow: its branch's, else the prompt's."""
        return self.cfg.branch if self.cfg is not None else 0

    def own_rows(self, noise: Latent, device: torch.device) -> Latent:
        """This rank's rows of the whole latent, in its own sequence's split."""
        own = {k: self.sequences[self.own].kind_spans(k)[self.runtime.rank] for k in self.kinds}
        return {k: noise[k][own[k].start : own[k].stop].to(device) for k in self.kinds}

    def velocity(self, index: int, latent: Latent, clocks: Clocks) -> Latent:
        """The model's velocity for this rank's rows of sequence `index` (an empty tensor for a kind it
        holds none of). The rows fed are recorded per sequence (`RankUsage.tokens`; the model's guard
        checked them against the sequence's split)."""
        sequence, rt = self.sequences[index], self.runtime
        inputs = sequence.local_inputs(rt.rank, latent)
        out = self.model(inputs, clocks, cache=self.cache_of(index))
        rt.used.tokens[sequence.plan.name] = inputs.rope.rows
        return {k: out.get(k, latent[k][:0].float()) for k in self.kinds}

    def moved(self, latent: Latent, src: int, dst: int) -> Latent:
        """Latent rows re-split from sequence `src`'s partition to sequence `dst`'s."""
        a, b, rt = self.sequences[src], self.sequences[dst], self.runtime
        return {k: repartition_rows(latent[k], a.kind_spans(k), b.kind_spans(k), rt.group, rt.stats) for k in self.kinds}

    def guided(self, latent: Latent, clocks: Clocks) -> Latent:
        """The velocity of one step: the prompt's, with guidance against the negative prompt's."""
        if self.cfg is not None:
            return self.guided_in_halves(latent, clocks)
        v = self.velocity(0, latent, clocks)
        if len(self.sequences) == 1:
            return v
        v_neg = self.moved(self.velocity(1, self.moved(latent, 0, 1), clocks), 1, 0)
        return {k: guided_velocity(v[k], v_neg[k], self.guidance_scale) for k in self.kinds}

    def guided_in_halves(self, latent: Latent, clocks: Clocks) -> Latent:
        """CFG parallel: this branch's velocity, the other's by one exchange, then the same guidance."""
        mine = self.velocity(self.own, latent, clocks)
        other = self.other_half(mine)
        cond, uncond = (mine, other) if self.own == 0 else (other, mine)
        return {k: guided_velocity(cond[k], uncond[k], self.guidance_scale) for k in self.kinds}

    def other_half(self, v: Latent) -> Latent:
        """The other branch's values of this rank's rows (one all-to-all over both halves, every kind in it)."""
        own, other, rt = self.sequences[self.own], self.sequences[1 - self.own], self.runtime
        parts = [(v[k], own.kind_spans(k), other.kind_spans(k)) for k in self.kinds]
        return dict(zip(self.kinds, exchange_halves(parts, self.cfg.group, rt.stats)))  # type: ignore[union-attr]

    def step(self, index: int, latent: Latent, device: torch.device) -> Latent:
        """One step of this rank's rows: one forward (guided), then each kind's Euler step on its own schedule, float32."""
        v = self.guided(latent, self.clocks(index, device))
        return {k: self.schedules[k].step(v[k], index, latent[k]) for k in self.kinds}

    def gather(self, latent: Latent) -> Latent:
        """Every rank's rows of the final latent (on every rank of its group): one gather per kind."""
        return {k: self.runtime.gather(latent[k], self.sequences[self.own].kind_spans(k)) for k in self.kinds}


def denoise(denoiser: Denoiser, latent: Latent, meter: DeviceMeter,
            profiler: Profiler | None, on_step: StepDoneCallback, gate: StepGate | None = None) -> tuple[Latent, list[float]]:
    """Every step of the schedules on this rank's rows; the final rows and each step's seconds.

    A NaN or inf in the latent stops the run at that step; `H3_INJECT_FAULT` can fail a chosen step;
    `gate` (None: never) is asked before every step and stops the loop with `StepsStopped`.
    """
    rank, seconds, steps, device = denoiser.runtime.rank, [], denoiser.num_steps, meter.device
    for i in range(steps):
        if gate is not None and gate(i):
            raise StepsStopped(i)
        maybe_inject_fault("step", rank, index=i)
        with meter.stopwatch() as watch, step_context(profiler):
            latent = denoiser.step(i, latent, device)
        seconds.append(watch.seconds)
        check_finite({k.value: x for k, x in latent.items()}, step=i + 1, steps=steps)
        on_step(i + 1, steps, watch.seconds)
    return latent, seconds
