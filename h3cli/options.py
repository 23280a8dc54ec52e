"""Option types shared by several commands (one definition, same help everywhere)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from h3core import settings

Json = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
Preset = Annotated[str, typer.Option("--preset", help="Model preset: h3, h3-2blocks, narrow, narrow-1k, wide-1k or tiny (a checkpoint's own config wins).")]
Width = Annotated[Optional[int], typer.Option("--width", help="Video width in pixels (default: the preset's).")]
Height = Annotated[Optional[int], typer.Option("--height", help="Video height in pixels (default: the preset's).")]
Frames = Annotated[Optional[int], typer.Option("--frames", help="Video frames at 24 fps, snapped up to the next 17n+5 the VAE encodes (default: the preset's; h3: 141).")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing folder of h3 results at --output whole (never mixed into; never a folder h3 did not write).")]

# --- what a generate run takes (h3 generate, h3 matrix) -------------------------------------------
Prompt = Annotated[Optional[str], typer.Option("--prompt", "-p", help="What to generate.", show_default=False)]
NegativePrompt = Annotated[str, typer.Option("--negative-prompt", help="Unconditional prompt for guidance (with --guidance != 1; stock H3 needs none).")]
Guidance = Annotated[float, typer.Option("--guidance", help="Classifier-free guidance scale (1 = off, one forward per step). Stock H3 is guidance-distilled and needs none; for fine-tuned checkpoints.")]
RunPreset = Annotated[Optional[str], typer.Option("--preset", help="h3, h3-2blocks, narrow, narrow-1k, wide-1k (CPU scaling) or tiny (default: tiny without --model, h3 with one).")]
CfgParallel = Annotated[bool, typer.Option("--cfg-parallel", help="With guidance (fine-tuned checkpoints; stock H3 needs none): half the ranks run the prompt, half the negative prompt, each half in the chosen mode; one exchange per step (needs an even count).")]
Replicas = Annotated[int, typer.Option("--replicas", help="Independent groups the ranks split into (replicas x [2 CFG halves] x ranks per sequence); with --prompts each group takes its own prompts (also across machines under torchrun).")]
Steps = Annotated[Optional[int], typer.Option("--steps", help="Sigma points of the two schedules, terminal 0 included: steps - 1 forwards (default: the preset's; h3: the official 50; the seed's runs: --steps 12).")]
Seed = Annotated[int, typer.Option("--seed", help="Noise seed (whose noise it means: --noise-recipe).")]
Keyframe = Annotated[Optional[list[str]], typer.Option("--keyframe", metavar="ROLE=PATH", help="FL2VA: first=PATH (the video starts on this image) and/or last=PATH (it ends on this one); PNG, JPEG or WebP. Without --width/--height the canvas follows the first keyframe's aspect (h3: short edge 768). docs/keyframes.md", show_default=False)]
NoiseRecipeOption = Annotated[str, typer.Option("--noise-recipe", help="Whose noise the seed means: official (the official server's, SGLang: video, audio and each keyframe from their own generators) or diffusers (diffusers' pipeline: one generator, keyframes, video, then audio).")]
VideoShift = Annotated[Optional[float], typer.Option("--video-shift", help="Flow shift of the video schedule (default: the preset's, 12; an adapter's own where its metadata sets one). Few-step adapters name theirs (docs/lora.md).", show_default=False)]
AudioShift = Annotated[Optional[float], typer.Option("--audio-shift", help="Flow shift of the audio schedule (default: the preset's, 3; an adapter's own where its metadata sets one).", show_default=False)]
Lora = Annotated[Optional[list[str]], typer.Option("--lora", help="A LoRA adapter, PATH[:SCALE] (repeatable; scale default 1): diffusers/PEFT or kohya/ComfyUI .safetensors, applied as a low-rank branch beside each linear it adapts, the (NVFP4) weights untouched (docs/lora.md).", show_default=False)]
DEFAULT_SEED = settings.DEFAULT_SEED
Device = Annotated[str, typer.Option("--device", help="auto, cpu or cuda (cpu: ranks are Gloo processes).")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="fp32, bf16 or fp16 (or torch's names: float32, bfloat16, float16); default: bf16 on CUDA, fp32 on CPU.")]
Model = Annotated[Optional[Path], typer.Option("--model", help=f"MiniMax-H3 transformer: a Comfy single file (bf16 or NVFP4, full or AdaLN-pruned), the official shards or a diffusers transformer/ folder (detected from the contents). Default: {settings.MODEL_PATH}, else the embedded synthetic one.", show_default=False)]
TextEncoder = Annotated[Optional[Path], typer.Option("--text-encoder", help=f"Qwen3-VL text encoder (file or folder). Default: {settings.TEXT_ENCODER_PATH}, else synthetic.", show_default=False)]
DecodedWeights = Annotated[str, typer.Option("--decoded-weights", help="Hold the NVFP4 linears decoded once instead of decoding them every forward (Hopper's cuda-dequant-bf16 path in bf16, the CPU's in the stream dtype; bitwise the same outputs): auto (where they fit beside the run's need), on, off.")]

# --- how a generate run runs and what it writes (h3 generate, h3 matrix) ------------------------------
Attention = Annotated[Optional[str], typer.Option("--attention", help="Attention backend: sdpa, math, sage2 or flash.", show_default="sdpa")]
SaveLatents = Annotated[Optional[bool], typer.Option("--save-latents/--no-save-latents", help=f"Write the latents (h3 matrix: each cell's). Default: {settings.SAVE_LATENTS} (0 = reports only), else yes.", show_default=False)]
Benchmark = Annotated[Optional[Path], typer.Option("--benchmark", help=f"Also write the result's JSON here (h3 generate: the report; h3 matrix: the matrix). Default: {settings.BENCHMARK}.", show_default=False)]
UlyssesOverlap = Annotated[str, typer.Option("--ulysses-overlap", help="Ulysses mode: split each all-to-all by head groups and run attention on one group while the next is in flight (bitwise the same outputs): auto (only where it has measured faster: not on Gloo/CPU), on, off. docs/overlap.md")]
Cache = Annotated[str, typer.Option("--cache", help="Step cache: off, or fbcache:THRESHOLD (First-Block Cache: a step whose first block's residual moved less than THRESHOLD since the last full step reuses the other blocks' residual; 0 never skips; the report counts the steps skipped). docs/cache.md")]
Compile = Annotated[bool, typer.Option("--compile/--no-compile", help="torch.compile the repeated transformer block once for all blocks (regional; needs a C++ compiler on the CPU); collectives stay outside the compiled pieces; compile time is reported apart from the step times; not with --profile (h3 matrix: turns its profiling off). docs/compile.md")]
Profile = Annotated[bool, typer.Option("--profile/--no-profile", help="Split every step's time per rank: attention, NVFP4 linears, each collective and the rest (table and report; costs <= 3%).")]


def output_folder(default: str) -> object:
    """`--output/-o` of a command whose results go in a new folder (`default`: the folder it makes when neither the flag nor H3_DISTRIBUTED_OUTPUT names one)."""
    return Annotated[Optional[Path], typer.Option("--output", "-o", help=f"Result folder: new or empty (see --overwrite). Default: {settings.OUTPUT}, else {default}.", show_default=False)]


GenerateOutput = output_folder("outputs/<time>-generate-<mode>-<N>-<4 hex>")
MatrixOutput = output_folder("outputs/<time>-matrix-<4 hex>")

VideoVae = Annotated[Optional[Path], typer.Option("--video-vae", help="Video VAE: minimax_h3_video_vae_fp16.safetensors, a diffusers vae/ folder or MiniMax's video_vae/. Default: H3_VIDEO_VAE_PATH, else beside H3_MODEL_PATH's transformer/, else (synthetic transformer only) synthetic.", show_default=False)]
AudioVae = Annotated[Optional[Path], typer.Option("--audio-vae", help="Audio VAE: minimax_h3_audio_vae_fp32.safetensors or an audio_vae/ folder. Default: H3_AUDIO_VAE_PATH, else beside H3_MODEL_PATH's transformer/, else (synthetic transformer only) synthetic.", show_default=False)]


# --- help panels: the long help of the run commands, grouped so it reads in one screen per panel ---------
PANELS: dict[str, tuple[str, ...]] = {
    "Prompt and media": ("--prompt", "--prompts", "--negative-prompt", "--keyframe", "--lora", "--guidance", "--seed", "--noise-recipe",
                         "--preset", "--width", "--height", "--frames", "--steps", "--video-shift", "--audio-shift"),
    "Model files": ("--model", "--text-encoder", "--video-vae", "--audio-vae", "--dtype"),
    "Distributed": ("--mode", "--gpus", "--counts", "--modes", "--replicas", "--cfg-parallel", "--device"),
    "Server": ("--host", "--port", "--api-key", "--state-dir", "--allow-path", "--max-queue", "--max-body-mb", "--max-image-mb", "--max-steps", "--max-frames", "--served-model-name"),
    "Output": ("--output", "--overwrite", "--save-latents", "--decode", "--benchmark", "--parity", "--json"),
    "Speed": ("--attention", "--decoded-weights", "--profile", "--compile", "--cache", "--ulysses-overlap"),
}
"""Where each run flag's help goes in `h3 generate`, `h3 serve` and `h3 matrix` (`PANELLED`)."""
PANELLED = ("generate", "serve", "matrix")
_PANEL_OF = {flag: panel for panel, flags in PANELS.items() for flag in flags}


def panel_of(flags: list[str] | tuple[str, ...]) -> str | None:
    """The help panel of an option known by `flags` (None: the command's own, "Options")."""
    return next((_PANEL_OF[f] for f in flags if f in _PANEL_OF), None)
