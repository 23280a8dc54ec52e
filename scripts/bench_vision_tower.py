"""What keyframes cost in the text encoder: the vision tower's load, its forward, and the whole
`encode_prompt` with keyframes against the same prompt without, measured side by side.

    python scripts/bench_vision_tower.py [--text-encoder PATH] [--width 5120] [--device cpu] [--repeats 5]

Without --text-encoder it runs h3's synthetic encoder (built once into H3_CACHE_DIR). The keyframes
are random 864x480 images (MINIMAX_H3.md 2.6: 405 image tokens each), one and two of them. Times
are medians of --repeats runs, the prompt with and without keyframes alternating; memory is the
device's peak (`h3core.runtime.device.peak_memory_bytes`: the CUDA allocator's peak, or the CPU
process's peak resident set) over one tower forward, above what was live before it, and the
tower's resident bytes.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from PIL import Image

from h3core.bench.alternate import alternate
from h3core.runtime import cpu_memory
from h3core.runtime import device as dev
from h3core.text import load_text_encoder
from h3core.text.encoder import vision_tower_bytes

PROMPT = "the fox turns its head towards the camera and runs off into the snow, wind noise and distant bells"


def _seconds(run, device: torch.device) -> float:
    with dev.Stopwatch(device) as watch:
        run()
    return watch.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-encoder", default=None, help="a text encoder file or folder (default: the synthetic one)")
    parser.add_argument("--width", type=int, default=5120, help="the denoiser's text width (5120: H3)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = dev.compute_dtype(device.type)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (480, 864, 3), dtype=np.uint8)) for _ in range(2)]

    encoder = load_text_encoder(args.text_encoder, hidden_size=args.width, device=device, dtype=dtype)
    info = encoder.info
    print(f"text encoder: {info.kind} {info.path}, width {info.hidden_size}, {info.device} {info.dtype}")
    print(f"vision tower from headers: {vision_tower_bytes(args.text_encoder, hidden_size=args.width):,} bytes")
    load = _seconds(encoder.vision_tower, device)
    spec, tower = encoder.vision_tower()
    print(f"vision tower: {spec.config.depth} blocks of {spec.config.hidden_size}, loaded in {load:.3f} s, "
          f"{encoder.info.vision_resident_bytes:,} bytes resident")

    for count in (1, 2):
        pixel_values, grids = spec.processor.pixel_values(images[:count])
        tower(pixel_values, grids)  # warm-up
        forward = statistics.median(_seconds(lambda: tower(pixel_values, grids), device) for _ in range(args.repeats))
        dev.release_memory(device.type)
        if device.type == "cpu":
            cpu_memory.release()  # hand freed heap back, so the window's peak is this forward's own growth
        dev.reset_peak_memory(device)
        live = _live_bytes(device)
        tower(pixel_values, grids)
        peak = dev.peak_memory_bytes(device) - live
        times = alternate({  # A B, B A, A B, ...: drift falls on both
            "images": lambda: _seconds(lambda: encoder.encode_prompt(PROMPT, images[:count]), device),
            "text": lambda: _seconds(lambda: encoder.encode_prompt(PROMPT), device),
        }, args.repeats, warmup=0)
        with_images, text_only = times["images"], times["text"]
        rows = encoder.encode_prompt(PROMPT, images[:count])[0].shape[0]
        a, b = statistics.median(with_images), statistics.median(text_only)
        print(f"{count} keyframe(s) 864x480 ({pixel_values.shape[0]} patches, {rows} rows): tower forward {forward:.3f} s "
              f"(median of {args.repeats}), peak +{peak / 2**20:.1f} MiB over the live memory; encode_prompt {a:.3f} s "
              f"vs {b:.3f} s text-only: x{a / b:.1f}")


def _live_bytes(device: torch.device) -> int:
    """What is allocated now: the CUDA allocator's bytes, or the CPU process's resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


if __name__ == "__main__":
    main()
