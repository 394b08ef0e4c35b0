"""0010: verl's log-prob fallback without flash-attn computes in chunks, not once per token (the plugin rebinds
``logprobs_from_logits`` inside two verl modules to its own chunked function, populora_verl/workers/logprobs.py)."""

from __future__ import annotations

PATCH = "0010-chunked-logprob-fallback.patch"

# verl's logprobs_from_logits on CPU (neither flash-attn nor the NPU kernel: the fallback) with packed logits of
# shape (tokens, vocab), as the FSDP engine passes them with remove-padding: the same values and gradients as
# log_softmax + gather, in a number of reductions that does not grow with the token count.
CHECK = """
import torch
from torch.overrides import TorchFunctionMode
import verl.utils.torch_functional as tf

assert not tf.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE and not tf.NPU_CROSS_ENTROPY_LOSS_AVAILABLE

class CountReductions(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("logsumexp", "log_softmax"):
            self.calls += 1
        return func(*args, **(kwargs or {}))

torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    logits = (3 * torch.randn(3000, 97)).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 97, (3000,))
    weights = torch.randn(3000)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
    with CountReductions() as counter:
        out = tf.logprobs_from_logits(logits, labels)
    assert out.shape == labels.shape
    assert torch.allclose(out.float(), ref, atol=tol, rtol=0), (dtype, (out.float() - ref).abs().max())
    (grad,) = torch.autograd.grad((out.float() * weights).sum(), logits)
    assert torch.allclose(grad.float(), ref_grad.float(), atol=tol, rtol=0), (dtype, (grad.float() - ref_grad).abs().max())
    print(dtype, "reductions:", counter.calls)
    assert counter.calls <= 4, f"{counter.calls} reductions for 3000 tokens: one per token"
print("ok")
"""


def test_fallback_is_chunked_and_exact(fails_without_passes_with):
    out = fails_without_passes_with(PATCH, CHECK, expect_without="reductions for 3000 tokens: one per token")
    assert "ok" in out
