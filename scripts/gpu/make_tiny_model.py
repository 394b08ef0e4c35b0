"""Build the tiny plumbing model for scripts/gpu/tiny_proof.sh: the real Qwen2.5 tokenizer + a 2-layer random Qwen2
(tied embeddings, head_dim 64 for FlashAttention, hidden 64 x heads), packed as a .tar.xz of a few MB.

    python scripts/gpu/make_tiny_model.py OUT.tar.xz [--tokenizer-from DIR] [--heads N]

Two heads (the default) let vLLM shard it over TP 2; use as many heads as the largest TP you will run.

The tokenizer comes from a converted offline Qwen checkpoint (`python -m populora_verl.models convert ...`).
Weights take two values per tensor: random enough for plumbing, and they compress well.
"""

import argparse
import os
import shutil
import tarfile
import tempfile

import torch
from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokenizer-from", default=os.path.expanduser("~/models/qwen-coder-0.5b"))
    ap.add_argument("--heads", type=int, default=2, help="attention and KV heads (TP must divide them)")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer_from)
    vocab = AutoConfig.from_pretrained(args.tokenizer_from).vocab_size  # Qwen pads it past len(tok): keep that shape
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64 * args.heads,
                      intermediate_size=128 * args.heads, num_hidden_layers=2,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads, tie_word_embeddings=True,
                      max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      rms_norm_eps=1e-6, rope_theta=10000.0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.sign(torch.randn_like(p, dtype=torch.float32)) * (0.5 / p.shape[-1] ** 0.5))
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "tiny-qwen")
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        with tarfile.open(args.out + ".tmp", "w:xz") as tf:
            tf.add(d, arcname="tiny-qwen")
    shutil.move(args.out + ".tmp", args.out)
    print(args.out, os.path.getsize(args.out))


if __name__ == "__main__":
    main()
