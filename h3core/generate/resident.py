"""Many requests, one load: the rank tasks of `h3 generate --prompts` (`h3core.batch`).

A World's ranks outlive its `World.run` calls (spawned workers serve task after task; at world
size 1 and under torchrun the task runs in the calling process), so a rank keeps its loaded
`RankPipeline` between calls on its own context (`RankContext.held`, which lives as long as the
World), keyed by everything that decides the load (`LoadKey`: checkpoint, config, mode, rank layout, this rank's heads and tensor shards, device,
dtype, attention backend, process group). A request's token spans are not in the key: they depend
on its size and text length, and `RankPipeline.denoise` takes them from the request's own plan.

The tasks, in the order a batch calls them:

- `encode_prompts_once`: rank 0 encodes every request's keyframes with the video VAE's encoder
  (loaded once per VAE, released), then loads the text encoder once, encodes every request's
  prompts (and negative prompts; with keyframes presented after them), releases it; each request's
  `Conditioning` goes back to the caller as its flat tensors;
- `denoise_round`: one request per replica group (`--replicas R`; one group is the plain case) on
  every rank: the held pipeline (loaded on the first call, or when the key changed), every group's
  texts broadcast from rank 0, `RankPipeline.denoise` of the rank's own group's request; the
  outcome is `rank_generate`'s, with the load seconds this request paid (0 once loaded);
- `drop_held`: forget the held pipeline (the end of a batch, or after a failed request).

`h3 serve` runs the same tasks on a World that lives as long as the server: it keeps rank 0's
text encoder loaded too (`encode_prompts_once(..., keep=True)`), loads every rank's pipeline
before the first job (`preload`), and gives each request a `JobControl`
(`h3core.generate.control`): a request stopped at a step boundary is that rank's `Stopped` outcome.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from h3core.generate.control import JobControl, RankGate, Stopped
from h3core.generate.loop import StepsStopped
from h3core.generate.pipeline import (
    RankPipeline,
    encode_request,
    finish_record,
    keyframe_latents,
    new_record,
    open_text_encoder,
    prepared_images,
    rank_runtime,
)
from h3core.generate.report import RankReport
from h3core.generate.request import ResolvedRun
from h3core.generate.sequences import Conditioning
from h3core.parallel.collectives import broadcast_tensors
from h3core.parallel.layout import RankGroups
from h3core.runtime import device as dev
from h3core.runtime.context import RankContext


class LoadKey(BaseModel):
    """What decides a rank's loaded pipeline; two requests with the same key share one load."""

    model_config = ConfigDict(frozen=True)
    checkpoint: str
    config: str  # the ModelConfig as JSON
    mode: str
    layout: str  # replicas x CFG halves x degree (`RankLayout`) as JSON: it decides the rank's groups
    rank_share: str  # this rank's heads and tensor shards as JSON
    device: str
    dtype: str | None
    attention: str
    compile: bool  # --compile: the blocks' forward is swapped at load
    group: int  # the process group's id: a new World is a new group

    @classmethod
    def of(cls, ctx: RankContext, run: ResolvedRun) -> "LoadKey":
        local = run.plan.layout.coords(ctx.rank).local
        share = run.plan.ranks[local].model_dump_json(include={"heads", "tensor"})
        return cls(
            checkpoint=str(run.checkpoint), config=run.config.model_dump_json(), mode=run.plan.mode.value,
            layout=run.plan.layout.model_dump_json(include={"replicas", "cfg", "degree"}), rank_share=share, device=str(ctx.device), dtype=run.request.dtype,
            attention=run.request.attention, compile=run.request.compile, group=id(ctx.group),
        )


class EncodedPrompts(BaseModel):
    """What rank 0's one text-encoder load gave: every request's hidden states and the time each took."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    texts: list[list[torch.Tensor]]  # per request: its `Conditioning.tensors()` (states, keyframe latents), CPU
    seconds: list[float]  # per request: its encode
    load_seconds: float  # loading and releasing the encoder, once
    peak_memory: int
    info: dict

    def for_reports(self) -> dict[str, Any]:
        """What every rank's outcome reports of the encoding (`denoise_round`'s `encoded`)."""
        return {"info": self.info, "peak_memory": self.peak_memory}


HELD = "pipeline"
"""The key of the loaded pipeline in `RankContext.held`: (LoadKey, RankPipeline)."""


def held_pipeline(ctx: RankContext, run: ResolvedRun) -> tuple[RankPipeline, float]:
    """This rank's pipeline for `run` and the seconds loading it cost now (0 when it was held)."""
    key = LoadKey.of(ctx, run)
    held = ctx.held.get(HELD)
    if held is not None and held[0] == key:
        return held[1], 0.0
    drop_held(ctx)
    pipeline = RankPipeline.load(ctx, run, rank_runtime(ctx, run))
    ctx.held[HELD] = (key, pipeline)
    return pipeline, pipeline.timings["load"]


def drop_held(ctx: RankContext) -> None:
    """Forget the held pipeline and hand its memory back (a World task on every rank)."""
    held = ctx.held.pop(HELD, None)
    if held is not None:
        dev.release_memory(held[1].device.type)


TEXT_ENCODER = "text_encoder"
"""The key of rank 0's kept text encoder in `RankContext.held` (`keep=True`): (its key, the encoder)."""


def encode_prompts_once(ctx: RankContext, runs: list[ResolvedRun], keep: bool = False) -> EncodedPrompts | None:
    """Rank 0: load the text encoder once, encode every run's prompts, release it (other ranks: None).
    Every run shares the encoder, its config's text width and the compute dtype (the batch's flags).
    `keep`: hold the encoder on rank 0 for the next call instead (a server's; loaded again only when
    the encoder, width, device or dtype differ)."""
    if ctx.rank != 0 or not runs:
        return None
    dev.reset_peak_memory(ctx.device)
    with dev.Stopwatch(ctx.device) as whole:
        keyframes = keyframe_latents(runs, ctx.device)  # (the VAE's encoder, released before the text encoder is used)
        encoder = _text_encoder(ctx, runs[0], keep)
        texts, seconds = [], []
        for run, latents in zip(runs, keyframes):
            with dev.Stopwatch(ctx.device) as watch:
                given = encode_request(encoder, run, prepared_images(run))
                given.keyframes = latents
                texts.append(given.tensors())
            seconds.append(watch.seconds)
        info = encoder.info.model_dump(mode="json")
        if not keep:
            from h3core.text import release_text_encoder

            release_text_encoder(encoder)
    return EncodedPrompts(texts=texts, seconds=seconds, load_seconds=whole.seconds - sum(seconds),
                          peak_memory=dev.peak_memory_bytes(ctx.device), info=info)


def _text_encoder(ctx: RankContext, run: ResolvedRun, keep: bool) -> Any:
    """The encoder `run` names: rank 0's kept one when it is that one, else loaded (and kept with `keep`)."""
    key = (str(run.request.text_encoder_path), run.config.text_dim, str(ctx.device), run.request.dtype)
    held = ctx.held.get(TEXT_ENCODER)
    if held is not None and held[0] == key:
        return held[1]
    drop_text_encoder(ctx)
    encoder = open_text_encoder(run, ctx.device)
    if keep:
        ctx.held[TEXT_ENCODER] = (key, encoder)
    return encoder


def drop_text_encoder(ctx: RankContext) -> None:
    """Release rank 0's kept text encoder, if any."""
    from h3core.text import release_text_encoder

    held = ctx.held.pop(TEXT_ENCODER, None)
    if held is not None:
        release_text_encoder(held[1])


def preload(ctx: RankContext, run: ResolvedRun) -> float:
    """Load every rank's pipeline for `run`'s layout before any request (a server's start; every rank
    of the World takes part in the groups' creation) and rank 0's text encoder (kept); the seconds
    this rank's load took."""
    layout = run.plan.layout
    RankGroups.create(ctx, layout)
    _, seconds = held_pipeline(ctx, run)
    if ctx.rank == 0:
        _text_encoder(ctx, run, keep=True)
    return seconds


def denoise_round(ctx: RankContext, runs: list[ResolvedRun | None], texts: list[list[torch.Tensor]] | None,
                  seconds: list[float], encoded: dict[str, Any], controls: list[JobControl | None] | None = None) -> RankReport | Stopped | None:
    """One request per replica group, all at once (module docstring): `runs[r]` is replica r's request
    (None: that group idles this round); `texts[r]` its hidden states (rank 0 has them all; the
    other ranks get them by one broadcast over the world); `seconds[r]` its encode time; `encoded`:
    rank 0's encoder info and peak memory while encoding (`info`, `peak_memory`).

    Every rank of the world takes part in the group creation and the broadcast; then each group runs
    its own request with its own collectives. Returns this rank's outcome (None on an idle rank);
    `controls[r]` (a server's) lets replica r's request be stopped at a step boundary, which makes
    the outcome `Stopped` on every rank of that group (`h3core.generate.control`)."""
    layout = next(run for run in runs if run is not None).plan.layout
    groups = RankGroups.create(ctx, layout)  # collective over the world once, cached: idle ranks must join it too
    replica = layout.coords(ctx.rank).replica
    run = runs[replica]
    pipeline, load_seconds = held_pipeline(ctx, run) if run is not None else (None, 0.0)
    if pipeline is not None:
        pipeline.runtime.new_records()
    stats = pipeline.runtime.stats if pipeline is not None else None
    flat = [t for group in texts for t in group] if ctx.rank == 0 and texts is not None else None
    received = broadcast_tensors(flat, src=0, group=ctx.group, device=ctx.device, stats=stats)
    if run is None or pipeline is None:
        return None
    record = new_record(ctx)
    record.timings.update(text_encode=seconds[replica], load=load_seconds)
    record.peak_memory_text_bytes, record.text_encoder = encoded.get("peak_memory", 0), encoded.get("info") if ctx.rank == 0 else None
    given = _given_of(runs, received, replica)
    control = controls[replica] if controls is not None else None
    gate = RankGate(ctx, control, groups) if control is not None and groups is not None else None
    report = ctx.report if gate is None else (lambda done: (ctx.report(done), gate.report(done)))
    try:
        whole = pipeline.denoise(run, given, record, report, gate)
    except StepsStopped as stop:
        return Stopped(step=stop.step, steps=run.shape.forwards)
    return finish_record(record, run, pipeline, whole, given.keyframes)


def _given_of(runs: list[ResolvedRun | None], received: list[torch.Tensor], replica: int) -> Conditioning:
    """Replica `replica`'s conditioning out of every group's, sent in replica order (each request has
    its prompt's states, with guidance its negative prompt's, and its keyframe latents if any)."""
    counts = [_tensors(run) for run in runs]
    start = sum(counts[:replica])
    run = runs[replica]
    assert run is not None
    return Conditioning.of_tensors(received[start : start + counts[replica]], len(run.request.prompts), run.keyframes is not None)


def _tensors(run: ResolvedRun | None) -> int:
    """How many tensors a request's conditioning travels as (`Conditioning.tensors`)."""
    return 0 if run is None else len(run.request.prompts) + int(run.keyframes is not None)
