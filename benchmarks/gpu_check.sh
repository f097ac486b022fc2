#!/usr/bin/env bash
# The single-device benchmark on a GPU, as one prepared call on a lent device machine:
# step_time.py's GPU preset (d768x12, vocab 32768, bf16 polar iteration) beside the torch peer,
# and contrib_muon beside optax.contrib.muon with the same arguments (its ratio and target,
# and their first steps compared).
#
# The peer lives beside the checkout (../shared/peers), which does not travel to the device,
# so copy it into the git-ignored .device/ first and carry that folder:
#
#   mkdir -p .device && cp -r ../shared/peers .device/
#   device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".device"], timeout_s=540)
#
# Writes env.txt, step_gpu.txt (the markdown tables) and step_gpu.json under $OUT.
# `--dry-run` runs the same plumbing on the CPU with step_time.py --quick.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/muon_optax_gpu}
PYTHON=${PYTHON:-python3}
PEER=()  # step_time.py looks in .device/peers, then in shared/peers beside the checkout
[ -n "${PEER_DIR:-}" ] && PEER=(--peer-dir "$PEER_DIR")
mkdir -p "$OUT"
if [ "${1:-}" = "--dry-run" ]; then args=(--quick); limit=300
else args=(--device gpu --reps 30); limit=480; fi  # 480 s: leaves room to copy $OUT back

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PYTHON" -c "import jax, optax, torch; print('jax', jax.__version__, jax.devices(), \
'optax', optax.__version__, 'torch', torch.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
PYTHONPATH=. timeout "$limit" "$PYTHON" benchmarks/step_time.py "${args[@]}" "${PEER[@]}" \
  --json "$OUT/step_gpu.json" > "$OUT/step_gpu.txt" 2>&1
rc=$?
grep -v "^WARNING" "$OUT/step_gpu.txt" | tail -n 60
[ "$rc" -eq 124 ] && echo "gpu_check: step_time.py ran past ${limit} s and was stopped"
exit "$rc"
