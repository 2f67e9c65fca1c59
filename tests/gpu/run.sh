#!/bin/bash
# The GPU tier, one command, on a host with an NVIDIA GPU (no systemd needed):
#   OUT=/some/dir tests/gpu/run.sh
# Writes $OUT/gpu.txt (results and measured figures), $OUT/gpu-run.log, and the
# foreground agent's log. Needs python3 and the NVIDIA driver; nothing to install:
# CUDA workers use the driver API through ctypes, NVML comes from a system pynvml
# or the copy vendored in agent/_vendor.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(pwd)/.work/gpu}
export OUT
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-run.log") 2>&1 </dev/null
PY=${PYTHON:-python3}
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

echo "== host"
uname -a
$PY --version
nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,driver_version --format=csv 2>&1 || echo "nvidia-smi: not available"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -1
if ! $PY -c "import pynvml" 2>/dev/null && ! $PY -c "import agent._vendor.pynvml" 2>/dev/null; then
    echo "run.sh: neither a system pynvml nor agent/_vendor/pynvml.py is importable; cannot reach NVML" | tee "$OUT/gpu.txt"
    exit 1
fi
$PY tests/gpu/cuda_worker.py probe

echo "== tests"
timeout 330 $PY tests/gpu/runner.py tests/gpu/test_layer.py tests/gpu/test_serve.py
rc=$?
echo "== done: exit $rc"
nvidia-smi --query-gpu=index,memory.used --format=csv 2>&1 || true
exit $rc
