#!/usr/bin/env bash
# The plugin on verl with patches/ applied, through verl's public API only (POPULORA_VERL_PUBLIC_ONLY=1: any private
# path the plugin keeps for verl 0.9.1 raises): the tiny-model GPU proof in one run to step 3 (evolution at 2, the
# children served under their new ids and trained at 3; per-adapter rollout-vs-trainer log-prob agreement from the
# debug probes), then the patch tests that need a real vLLM. Needs only the bundle (no model staging).
#   bash scripts/gpu/series_proof.sh [extra hydra overrides...]      (OUT: where the logs go)
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
SERIES=${SERIES_DIR:-/tmp/verl-series}
if [ ! -f "$SERIES/.applied" ]; then
  SRC=$(python3 -c "import os, verl; print(os.path.dirname(verl.__file__))") || exit 2
  rm -rf "$SERIES" && mkdir -p "$SERIES" && cp -r "$SRC" "$SERIES/verl" || exit 2
  find "$SERIES" -name __pycache__ -prune -exec rm -rf {} +
  for p in patches/*.patch; do
    patch -d "$SERIES" -p1 --forward -s -i "$PWD/$p" || { echo "series_proof: $p does not apply to $SRC" >&2; exit 2; }
  done
  touch "$SERIES/.applied"
fi
# Ray's workers inherit the driver's environment: the patched copy and the public-only switch reach them too.
PLAIN_PYTHONPATH=$PYTHONPATH
export PYTHONPATH="$SERIES:$PYTHONPATH" POPULORA_VERL_PUBLIC_ONLY=1 POPULORA_PYTHONPATH_FIRST=$SERIES
python3 - "$SERIES" <<'PY' | tee "$OUT/series_flags.txt" || exit 2
import sys
import verl
from populora_verl import verl_compat
assert verl.__file__.startswith(sys.argv[1]), f"verl imported from {verl.__file__}, not the patched copy"
detected = verl_compat.series_detected()
missing = [name for name, on in detected.items() if not on]
print(f"verl from {verl.__file__}; series detected: {len(detected) - len(missing)} of {len(detected)}")
sys.exit(f"series_proof: not detected with the series: {', '.join(missing)}" if missing else 0)
PY
GPU_PROOF_TIMEOUT_S=${GPU_PROOF_TIMEOUT_S:-420} GPU_PROOF_PHASE=one bash scripts/gpu/tiny_proof.sh "$@"
rc=$?
# the patch tests copy the installed verl and apply each patch themselves: run them against the unpatched one
PYTHONPATH=$PLAIN_PYTHONPATH POPULORA_VERL_PUBLIC_ONLY= \
  python3 -m pytest -q -rA --tb=long -p no:cacheprovider tests/patches/test_vllm_max_loras.py \
  tests/patches/test_vllm_multi_adapter_sync.py > "$OUT/series_vllm_patch_tests.log" 2>&1
trc=$?
tail -3 "$OUT/series_vllm_patch_tests.log"
echo "series_proof: tiny proof rc=$rc, real-vLLM patch tests rc=$trc"
[ "$rc" -eq 0 ] && [ "$trc" -eq 0 ]
