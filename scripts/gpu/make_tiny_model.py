"""Build the tiny plumbing model for scripts/gpu/tiny_proof.sh: the real Qwen2.5 tokenizer + a 2-layer random Qwen2
(tied embeddings, head_dim 64 for FlashAttention, hidden 64 x heads), packed as a .tar.xz of a few MB.

    python scripts/gpu/make_tiny_model.py OUT.tar.xz [--tokenizer-from DIR] [--heads N]

Two heads (the default) let vLLM shard it over TP 2; use as many heads as the largest TP you will run.

The tokenizer comes from a converted offline Qwen checkpoint (`python -m populora_verl.models convert ...`). The
model is `python -m populora_verl.models random qwen2-plumbing` (populora_verl.random_model) with N heads: weights
take two values per tensor, random enough for plumbing, and they compress well.
"""

import argparse
import os
import shutil
import tarfile
import tempfile

from populora_verl.random_model import plumbing_shape, write_random_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokenizer-from", default=os.path.expanduser("~/models/qwen-coder-0.5b"))
    ap.add_argument("--heads", type=int, default=2, help="attention and KV heads (TP must divide them)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d, _ = write_random_model(plumbing_shape(args.heads), os.path.join(tmp, "tiny-qwen"), args.tokenizer_from)
        with tarfile.open(args.out + ".tmp", "w:xz") as tf:
            tf.add(d, arcname="tiny-qwen")
    shutil.move(args.out + ".tmp", args.out)
    print(args.out, os.path.getsize(args.out))


if __name__ == "__main__":
    main()
