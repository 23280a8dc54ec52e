#!/usr/bin/env bash
# Install h3 and its dependencies into RunPod's PyTorch image without replacing the image's CUDA
# build of torch: every torch/triton/nvidia-* package already installed is pinned as a pip
# constraint, and the script fails if torch's version or CUDA build changed anyway.
#
#   scripts/install_runpod.sh -e             # on a pod: editable install of this checkout
#   scripts/install_runpod.sh --no-cache-dir # in scripts/Dockerfile.runpod
#
# Extra arguments go to `pip install` before the project path. PYTHON selects the interpreter.
set -euo pipefail

cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

torch_build() {
  "$python" -c 'import torch; print(torch.__version__, torch.version.cuda)'
}

if ! before=$(torch_build 2>/dev/null); then
  echo "error: torch is not importable by $python; use RunPod's PyTorch image (runpod/pytorch:*-cu1300-torch291-*)" >&2
  exit 1
fi

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$python" -m pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton|nvidia-[a-z0-9-]+)==' >"$constraints"

# Ubuntu 24.04 marks its Python as externally managed; the image's Python belongs to this job.
PIP_BREAK_SYSTEM_PACKAGES=1 "$python" -m pip install -c "$constraints" "$@" .

after=$(torch_build)
if [[ "$before" != "$after" ]]; then
  echo "error: installing h3 changed torch from '$before' to '$after'; reinstall the image's torch" >&2
  exit 1
fi
echo "h3 installed; torch $after kept"
