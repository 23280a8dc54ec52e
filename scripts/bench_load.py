#!/usr/bin/env python3
"""Each loader against reading the same bytes with `cat FILE > /dev/null` (issue 35.2; target: at
most 1.3x), alternating in one run, median of N.

    python scripts/bench_load.py --repeat 5
    python scripts/bench_load.py --repeat 5 --preset narrow-1k   # a smaller transformer
    python scripts/bench_load.py --repeat 5 --before ../h3-old      # this tree vs another checkout

With `--before`, each load is a fresh process per tree (this script with that tree first on
PYTHONPATH; one untimed load, then the timed one), alternating this tree, the other and `cat`.

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
import sys
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


def in_tree(tree: Path, preset_name: str, arm: str) -> float:
    """One timed load of `arm` (after an untimed one) in a fresh process importing h3 from `tree`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH", "")]))}
    command = [sys.executable, __file__, "--preset", preset_name, "--worker", arm]
    return float(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout.split()[-1])


def compare(before: Path, preset_name: str, repeat: int) -> None:
    here = Path(__file__).resolve().parent.parent
    arms = loaders(preset_name)
    print(f"median of {repeat}, alternating this tree / {before} / cat, fresh processes, warm page cache, load average {os.getloadavg()[0]:.2f}")
    for name, (files, _) in arms.items():
        times: dict[str, list[float]] = {"after": [], "before": [], "cat": []}
        steps = {"after": lambda: in_tree(here, preset_name, name), "before": lambda: in_tree(before, preset_name, name), "cat": lambda: cat_seconds(files)}
        for i in range(repeat):
            for key in (list(steps) if i % 2 == 0 else list(reversed(steps))):
                times[key].append(steps[key]())
        after, old, read = (statistics.median(times[k]) for k in ("after", "before", "cat"))
        print(f"  {name:34s} before {old:7.3f} s ({old / read:6.2f}x cat)  after {after:7.3f} s ({after / read:6.2f}x cat)  after/before {after / old:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timings of each arm (median of these)")
    parser.add_argument("--preset", default="h3-2blocks", help="the transformer's size (a preset name)")
    parser.add_argument("--before", type=Path, help="another checkout: time its loaders too, alternating")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one arm's timed load, printed (for --before)
    args = parser.parse_args()
    if args.worker:
        load = loaders(args.preset)[args.worker][1]
        load_seconds(load)
        print(load_seconds(load))
        return
    if args.before:
        compare(args.before.resolve(), args.preset, args.repeat)
        return
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
