#!/usr/bin/env python3
"""Each loader against reading the same bytes with `cat FILE > /dev/null` (issue 35.2; target: at
most 1.3x), alternating in one run, median of N.

    python scripts/bench_load.py --repeat 5
    python scripts/bench_load.py --repeat 5 --preset narrow-1k   # a smaller transformer

Loaders timed (in this process, imports done before timing), each on h3's synthetic files in the
cache folder (written once when missing):

- the transformer (`load_transformer`, the Comfy NVFP4 single file, `--preset`, default h3-2blocks:
  2.0 GB) onto the CPU in float32;
- the text encoder (`load_text_encoder`, its synthetic file);
- the video VAE and the audio VAE (`Decoders.load`'s `load_vae`, decoder only, the Comfy files).

The page cache is warm for both arms (the files were just written or read; dropping it would slow
every other process on a shared machine): this compares the loader's work with the kernel's copy of
the same bytes, not with the disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable


def loaders(preset_name: str) -> dict[str, tuple[list[Path], Callable[[], object]]]:
    """name -> (the files it reads, a call that loads it)."""
    from h3core.decode.load import load_vae
    from h3core.decode.synthetic import synthetic_vae_file
    from h3core.decode.vae_files import find_vae_files
    from h3core.model.checkpoint import load_transformer
    from h3core.model.config import preset
    from h3core.model.synthetic import synthetic_checkpoint
    from h3core.text.encoder import load_text_encoder
    from h3core.text.synthetic import synthetic_text_encoder

    config = preset(preset_name)
    transformer = synthetic_checkpoint(config)[0]
    text = synthetic_text_encoder(config.text_dim)[0]
    out: dict[str, tuple[list[Path], Callable[[], object]]] = {
        f"transformer ({preset_name}, Comfy NVFP4)": ([transformer], lambda: load_transformer(transformer)),
        "text encoder": ([text], lambda: load_text_encoder(text, hidden_size=config.text_dim)),
    }
    for role in ("video", "audio"):
        path = synthetic_vae_file(role)[0]
        out[f"{role} VAE"] = ([path], lambda path=path, role=role: load_vae(find_vae_files(path, role, "bench")))
    return out


def cat_seconds(files: list[Path]) -> float:
    began = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        subprocess.run(["cat", *map(str, files)], stdout=sink, check=True)
    return time.perf_counter() - began


def load_seconds(load: Callable[[], object]) -> float:
    began = time.perf_counter()
    loaded = load()
    seconds = time.perf_counter() - began
    del loaded
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timings of each arm (median of these)")
    parser.add_argument("--preset", default="h3-2blocks", help="the transformer's size (a preset name)")
    args = parser.parse_args()
    arms = loaders(args.preset)
    print(f"median of {args.repeat}, alternating loader / cat, warm page cache, load average {os.getloadavg()[0]:.2f}")
    for name, (files, load) in arms.items():
        load_seconds(load)  # warm-up: first-call costs, page cache
        loads, cats = [], []
        for i in range(args.repeat):
            pair = (lambda: loads.append(load_seconds(load)), lambda: cats.append(cat_seconds(files)))
            for step in pair if i % 2 == 0 else reversed(pair):
                step()
        size = sum(f.stat().st_size for f in files)
        loaded, read = statistics.median(loads), statistics.median(cats)
        print(f"  {name:34s} {size / 1e6:9.1f} MB  load {loaded:7.3f} s  cat {read:7.3f} s  ratio {loaded / read:5.2f}x")


if __name__ == "__main__":
    main()
