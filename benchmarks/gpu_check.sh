#!/usr/bin/env bash
# The GPU benchmark as one prepared call on a lent device machine (BENCHMARKS.md, "GPU preset"):
# step_time.py's GPU preset (d768 x 12, vocab 32768, bf16 polar iteration) beside the torch peer.
#
# The peer lives beside the checkout (../shared/peers), which does not travel to the device, so
# copy it into an ignored folder of the checkout first and carry that folder:
#
#   mkdir -p .device && cp -r ../shared/peers .device/        # .device/ is in .gitignore
#   device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".device"], timeout_s=540)
#
# Writes env.txt, step_gpu.txt and step_gpu.json under $OUT (the folder that comes back) and
# prints the tables. `--dry-run` runs the same plumbing on the CPU at a toy size: it checks
# this script, not the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/muon_optax_gpu}
PYTHON=${PYTHON:-python3}
PEER=${PEER_DIR:-.device/peers}
[ -d "$PEER" ] || PEER=../shared/peers
mkdir -p "$OUT"

if [ "${1:-}" = "--dry-run" ]; then
  args=(--device cpu --n-embd 64 --n-layer 2 --vocab 256 --reps 3 --warmup 1)
  limit=300
else
  args=(--device gpu --reps 30)
  limit=480  # leaves the device call's 540 s room to copy the results back
fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PYTHON" -c "import jax, optax, torch; print('jax', jax.__version__, jax.devices(), \
'optax', optax.__version__, 'torch', torch.__version__)"
  echo "peer: $PEER"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

PYTHONPATH=. timeout "$limit" "$PYTHON" benchmarks/step_time.py "${args[@]}" --peer-dir "$PEER" \
  --json "$OUT/step_gpu.json" > "$OUT/step_gpu.txt" 2>&1
rc=$?
grep -v "^WARNING" "$OUT/step_gpu.txt" | tail -n 80
[ "$rc" -eq 124 ] && echo "gpu_check: step_time.py ran past ${limit} s and was stopped"
exit "$rc"
