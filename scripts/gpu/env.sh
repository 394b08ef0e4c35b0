# Source on a GPU node without network: the carried vLLM/verl/Ray bundle, our package, offline-safe settings.
eval "$(bash .gpub/tool/gpu-bundle-install.sh env 2>/dev/null || bash .gpub/02/gpu-bundle-install.sh env)"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 RAY_AUTH_MODE=disabled
export VERL_USE_EXTERNAL_MODULES=populora_verl.plugin  # no pip install there: load the plugin by module
export MODEL_DIR=${MODEL_DIR:-/tmp/models/qwen-coder-0.5b}
# Our own pure-Python deps that the image lacks (trueskill, radon, pyribs), installed once per machine.
if [ ! -d /tmp/populora-site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/populora-site .gpuwork/whl/*.whl
fi
export PYTHONPATH="$PYTHONPATH:/tmp/populora-site"
export PATH="$PATH:/tmp/populora-site/bin"  # py-spy, where its wheel came along: stacks of a hung arm
# A patched verl copy put first by the caller (scripts/gpu/series_proof.sh) stays ahead of the bundle
if [ -n "${POPULORA_PYTHONPATH_FIRST:-}" ]; then export PYTHONPATH="$POPULORA_PYTHONPATH_FIRST:$PYTHONPATH"; fi
