#!/usr/bin/env python3
"""h3's transformer against diffusers' `MiniMaxH3Transformer3DModel` on the same weights, side by side
in one run on this machine (issue 34.2).

A random diffusers model with the released model's proportions at a smaller width (56 heads of 32
channels, hidden 1344 = 3/4 of the attention width, ffn 2.67x hidden, 3/4 of each head rotated) is
saved once as a diffusers folder and loaded by both: diffusers (`from_pretrained`, its float32
islands kept) and h3 (`load_transformer`, the same folder). Both run one packed t2va step built by
diffusers' own pipeline steps. Per dtype (fp32, bf16) it times, alternating A and B in one loop
(the order flipped every round, so that drift on a shared machine hits both alike):

- forward: one transformer call in diffusers' argument names each (h3: `diffusers_forward`, which
  packs the rows, refines the text and runs the model; diffusers: `model(**inputs)`);
- step: what a denoising step costs each pipeline: diffusers calls the same forward every step;
  h3 refines the text once per request and runs `H3Model.forward` on the packed sequence.

and prints the median of --repeat runs of each (wall and CPU seconds), h3/diffusers (the ratio of the medians, and the
median of each round's own ratio: the two runs of a round are neighbours in time, so they share
the load of a shared machine more closely), and the outputs' agreement (max |h3 - diffusers| /
max |diffusers|, video and audio).

    python scripts/bench_reference.py --repeat 7
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from h3core.model.checkpoint import load_transformer
from h3core.model.packing import diffusers_forward, diffusers_sequence

INPUT_NAMES = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices",
               "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")


def model_config(heads: int, head_dim: int, blocks: int) -> dict[str, object]:
    """The released model's proportions at `heads x head_dim`: hidden 3/4 of the attention width,
    ffn 8/3 of hidden, 3/4 of each head rotated (the release: 56 x 128, 5376, 14336, 96 of 128)."""
    width = heads * head_dim
    hidden = 3 * width // 4
    return dict(num_attention_heads=heads, attention_head_dim=head_dim, hidden_size=hidden, num_layers=blocks,
                num_refiner_layers=2, ffn_dim=8 * hidden // 3, in_channels=24, audio_in_channels=32, text_dim=256,
                freq_dim=256, time_embed_hidden_dim=512, time_embed_dim=512, rope_freq_dim=head_dim // 8)


def save_random_model(config: dict[str, object], folder: Path) -> None:
    """A diffusers model with every weight random (norm weights near 1), saved as a diffusers folder."""
    from diffusers import MiniMaxH3Transformer3DModel

    model = MiniMaxH3Transformer3DModel(**config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=generator) * scale + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder)


def packed_inputs(config: dict[str, object], frames: int, height: int, width: int, text: int, audio: int) -> dict[str, torch.Tensor]:
    """One t2va step's transformer arguments, laid out by diffusers' pipeline steps, random latents and text."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
        patchify_video_latents,
    )

    patch = (1, 2, 2)
    generator = torch.Generator().manual_seed(3)
    positions, tags, video, audio_rows, text_rows, cond_v, cond_a = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(text, dtype=torch.long), frames, height, width, audio, patch, 2, 2, 0)
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(video, audio_rows, cond_v, cond_a, text, 0.3, 0.55, 0.999, 1.0)
    latents = torch.randn(1, int(config["in_channels"]), frames, height, width, generator=generator)
    return dict(
        hidden_states=patchify_video_latents(latents, patch)[None],
        audio_hidden_states=torch.randn(1, 2 * audio, int(config["audio_in_channels"]), generator=generator),
        encoder_hidden_states=torch.randn(1, text, int(config["text_dim"]), generator=generator),
        timestep=timestep, timestep_indices=timestep_indices, token_tags=tags, position_ids=positions,
        video_indices=video, audio_indices=audio_rows, text_indices=text_rows,
    )


def alternate(a: Callable[[], object], b: Callable[[], object], repeat: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(wall, CPU) seconds of `repeat` calls of each, A and B alternating, the order flipped every round
    (after one warm-up each). CPU seconds are this process's (every thread's) `time.process_time`:
    on a machine others load, the time it was not scheduled does not count."""
    a(), b()
    times: tuple[list[tuple[float, float]], list[tuple[float, float]]] = ([], [])
    for i in range(repeat):
        order = ((0, a), (1, b)) if i % 2 == 0 else ((1, b), (0, a))
        for which, run in order:
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            times[which].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max())


Timings = list[tuple[float, float]]


def compare(folder: Path, inputs: dict[str, torch.Tensor], dtype: torch.dtype, repeat: int) -> list[tuple[str, Timings, Timings, str]]:
    """Rows (what, h3 seconds, diffusers seconds, agreement) of one dtype."""
    from diffusers import MiniMaxH3Transformer3DModel

    theirs = MiniMaxH3Transformer3DModel.from_pretrained(folder, torch_dtype=dtype).eval()
    ours = load_transformer(folder, dtype=dtype)
    with torch.inference_mode():
        expected = theirs(**inputs, return_dict=False)
        got = diffusers_forward(ours, **inputs)
        agreement = "video {:.1e}, audio {:.1e}".format(*(relative_error(g, e) for g, e in zip(got, expected)))
        seq, clocks, _ = diffusers_sequence(ours, *(inputs[name] for name in INPUT_NAMES))  # text refined once, as per request
        forward = alternate(lambda: diffusers_forward(ours, **inputs), lambda: theirs(**inputs, return_dict=False), repeat)
        step = alternate(lambda: ours(seq, clocks), lambda: theirs(**inputs, return_dict=False), repeat)
    return [("forward", *forward, agreement), ("step", *step, "")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--frames", type=int, default=3, help="latent frames")
    parser.add_argument("--height", type=int, default=24, help="latent height (2 per row)")
    parser.add_argument("--width", type=int, default=40, help="latent width (2 per row)")
    parser.add_argument("--text", type=int, default=96, help="text rows")
    parser.add_argument("--audio", type=int, default=64, help="audio latents (2 rows each)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtypes", default="fp32,bf16")
    args = parser.parse_args()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    config = model_config(args.heads, args.head_dim, args.blocks)
    inputs = packed_inputs(config, args.frames, args.height, args.width, args.text, args.audio)
    rows = int(inputs["position_ids"].shape[0])
    table = Table(title=f"h3 vs diffusers {args.heads}x{args.head_dim} heads, hidden {config['hidden_size']}, {args.blocks} blocks + 2 refiner, "
                        f"{rows} rows, {torch.get_num_threads()} threads, median of {args.repeat} alternating runs", title_justify="left")
    for column in ("dtype", "what", "clock", "h3 s", "diffusers s", "h3/diffusers", "rounds' ratios", "agreement (max|diff| / max|ref|)"):
        table.add_column(column)
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(config, Path(tmp))
        for name in args.dtypes.split(","):
            for what, ours, theirs, agreement in compare(Path(tmp), inputs, dtypes[name], args.repeat):
                for clock in (0, 1):
                    h3, ref = [t[clock] for t in ours], [t[clock] for t in theirs]
                    a, b = statistics.median(h3), statistics.median(ref)
                    rounds = statistics.median(x / y for x, y in zip(h3, ref))
                    table.add_row(name, what, ("wall", "CPU")[clock], f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}", f"{rounds:.2f}", "" if clock else agreement)
    Console().print(table)


if __name__ == "__main__":
    main()
