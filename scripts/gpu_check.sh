#!/usr/bin/env bash
# One prepared GPU check of h3 on whatever GPUs are visible; every report under one folder.
#
#   scripts/gpu_check.sh [OUTPUT_DIR]        (default outputs/gpu-check-<UTC time>)
#
# Steps (each runs even if an earlier one failed; their exit codes are in summary.txt):
#   1. environment: GPUs, driver, torch, CUDA
#   2. the GPU test tier (pytest tests/gpu)
#   3. h3 verify on CUDA at the counts that fit (NCCL, bf16)
#   4. h3 bench-transport at 1 rank with H3's real shapes (864x480, 141 frames, 56 x 128 heads)
#   5. NVFP4 linear benchmark at H3 shapes: bf16 GEMM vs the NVFP4 path, TFLOP/s
#   6. h3 generate on the h3-2blocks preset (real widths and sequence, 2 of 50 blocks, synthetic
#      weights), with --parity (at one GPU: Ulysses vs tensor mode, the identity path)
# Sized to finish in under 8 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
step() {  # step NAME LOGFILE COMMAND...: run, keep its output, record its exit code
  local name=$1 log=$2
  shift 2
  local start=$SECONDS
  "$@" >"$log" 2>&1
  local rc=$?
  printf '%-16s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - start))" "$log" | tee -a "$summary"
}
export PYTHONUNBUFFERED=1

step environment "$out/environment.txt" bash -c 'nvidia-smi; python -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpus\", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], \"capability\", torch.cuda.get_device_capability(0))"'
step gpu-tests "$out/gpu-tests.log" python -m pytest -q -rs tests/gpu
step verify "$out/verify.json" h3 verify --device cuda --output "$out/verify" --json
step bench-transport "$out/bench-transport.json" h3 bench-transport 1 sdpa --device cuda --width 864 --height 480 --frames 141 --iters 20 --json
step nvfp4-linear "$out/nvfp4-linear.log" python scripts/bench_nvfp4_linear.py --device cuda --tokens 4096 --repeat 20 --json "$out/nvfp4-linear.json"
step generate "$out/generate.json" h3 generate --device cuda --preset h3-2blocks --steps 4 --parity --no-save-latents --output "$out/generate" --json

python - "$out" <<'PY' | tee -a "$summary"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
nv = load("nvfp4-linear.json")
for row in nv.get("rows", []):
    print(f"nvfp4 {row['name']:<10} {row['shape']:<12} bf16 {row['dense_tflops']:.1f} TFLOP/s  nvfp4 {row['nvfp4_tflops']:.1f} TFLOP/s  ({row['path']})")
gen = load("generate.json")
if "timings" in gen:
    steps = sorted(gen["step_seconds"])
    print(f"generate {gen['config']['name']} on {gen['device_name']}: sampling {gen['timings']['sampling']:.2f}s, "
          f"median step {steps[len(steps) // 2]:.3f}s, peak {max(r['peak_memory_sampling_bytes'] for r in gen['ranks']):,} bytes, "
          f"attention {gen['attention_kernel']}, NVFP4 {gen['nvfp4_path']}, parity {gen.get('parity', {}) and gen['parity']['relative']}")
else:
    print("generate:", gen.get("error"))
PY
echo "reports in $out"
