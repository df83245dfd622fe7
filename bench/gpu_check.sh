#!/usr/bin/env bash
# The GPU check of the checkpoint benchmark (docs/benchmark.md, "GPU check"): ckptlib against
# torch.save, torch.distributed.checkpoint (sync and async_save) and a pinned memcpy, on a state of
# about 3.6 GB living on a CUDA device (tinylm with d_model 1024 x 24 layers: ~300 M fp32 params +
# AdamW moments), in one call of a few minutes. Prints the table and the targets; writes the
# records to $OUT/gpu-bench.json (or bench/gpu-bench.json) with the GPU's name.
#
#   bench/gpu_check.sh                 # needs a CUDA build of torch and this project installed
#   PYTHON=/path/to/python bench/gpu_check.sh
#   GPU_CHECK_EXTRA='{"d_model": 512, "n_layers": 8}' bench/gpu_check.sh   # a smaller state
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT_DIR="${OUT:-bench}"
mkdir -p "$OUT_DIR"
"$PY" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: torch is not importable by this python; set PYTHON= to one with torch and this project")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device: run this on a GPU machine with a CUDA build of torch")
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
EXTRA="${GPU_CHECK_EXTRA:-{\"d_model\": 1024, \"n_layers\": 24, \"n_heads\": 16}}"
exec "$PY" -m ckpt.cli bench --device cuda --workloads tinylm --size bench --workload-extra "$EXTRA" \
  --saves "${GPU_CHECK_SAVES:-4}" --steps-between 1 --json "$OUT_DIR/gpu-bench.json"
