"""populora_verl.workers.logprobs: verl's log-prob fallback without its per-token loop."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from populora_verl.workers import logprobs as lp

from _shared import RECIPES, finished, run_side_by_side


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])  # chunk boundaries inside, at and past the rows
@pytest.mark.parametrize("shape", [(13, 29), (2, 5, 29)])
def test_values_and_gradients_equal_log_softmax_gather(chunk, shape):
    gen = torch.Generator().manual_seed(1)
    z = (torch.randn(*shape, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    y = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    w = torch.randn(shape[:-1], generator=gen, dtype=torch.float64)  # a non-uniform upstream gradient
    out = lp.label_logprobs(z, y, chunk=chunk)
    assert out.dtype == torch.float32 and out.shape == y.shape
    (gz,) = torch.autograd.grad((out.double() * w).sum(), z)
    z2 = z.detach().clone().requires_grad_(True)
    ref = _reference(z2, y)
    (gref,) = torch.autograd.grad((ref.double() * w).sum(), z2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gz, gref, rtol=1e-5, atol=1e-6)


def test_matches_verls_own_fallback_in_bfloat16():
    """The quantity verl's actor computes today (logprobs_from_logits_v2 on bf16 logits), to bf16 precision."""
    from verl.utils.torch_functional import logprobs_from_logits_v2

    gen = torch.Generator().manual_seed(2)
    z = (torch.randn(40, 151, generator=gen) * 4).to(torch.bfloat16)
    y = torch.randint(0, 151, (40,), generator=gen)
    ref = logprobs_from_logits_v2(z.clone(), y).float()
    za = z.clone().requires_grad_(True)
    out = lp.label_logprobs(za, y, chunk=16)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=4e-2)
    out.sum().backward()
    assert za.grad.dtype == torch.bfloat16 and torch.isfinite(za.grad.float()).all()
    # each row's gradient of log p(y) sums to zero (onehot - softmax)
    assert za.grad.float().sum(-1).abs().max() < 5e-2


def test_bad_shapes_and_chunks_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        lp.label_logprobs(torch.zeros(4, 7), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk"):
        lp.label_logprobs(torch.zeros(4, 7), torch.zeros(4, dtype=torch.long), chunk=0)
    with pytest.raises(ValueError, match="POPULORA_LOGPROBS"):
        lp.install("fast")


_INSTALL = r'''
import os, sys, torch
mode = sys.argv[1]
import verl.utils.torch_functional as tf
import verl.workers.engine.fsdp.transformer_impl as eng
from populora_verl.workers import logprobs as lp
before = eng.logprobs_from_logits
done = lp.install(None if mode == "env" else mode)
print("INSTALLED", done, eng.logprobs_from_logits is lp.verl_logprobs_from_logits,
      tf.logprobs_from_logits is lp.verl_logprobs_from_logits, eng.logprobs_from_logits is before)
'''


_ENGINE_PATH = _INSTALL + r'''
z = torch.randn(6, 11, dtype=torch.bfloat16); y = torch.randint(0, 11, (6,))
out = eng.logprobs_from_logits(logits=z, labels=y)
print("DTYPE", out.dtype)
'''

INSTALL_CASES = [
    ("auto", {}, "INSTALLED True True True False"),
    ("env", {"POPULORA_LOGPROBS": "verl"}, "INSTALLED False False False True"),
    ("env", {}, "INSTALLED True True True False"),  # the default is auto
    ("auto", {"VERL_DISABLE_FLASH_ATTN_CE": "1"}, "INSTALLED True True True False"),
]


@pytest.fixture(scope="module")
def own_processes():
    """Each case below in its own fresh interpreter (install() rebinds module globals of verl for the whole
    interpreter), all run side by side once: case index (or "engine") -> the finished process."""
    base = {k: v for k, v in os.environ.items() if k != lp.ENV}  # only the case's setting, none inherited
    jobs = {i: {"args": [sys.executable, "-c", _INSTALL, mode], "env": {**base, **env}}
            for i, (mode, env, _) in enumerate(INSTALL_CASES)}
    jobs["engine"] = {"args": [sys.executable, "-c", _ENGINE_PATH, "auto"]}
    return run_side_by_side(jobs)


@pytest.mark.parametrize("mode,env,expect", INSTALL_CASES)
def test_install_replaces_verls_fallback_where_the_engine_calls_it(mode, env, expect, own_processes):
    """Own process: install() rebinds module globals of verl for the whole interpreter (only where verl's fallback is
    the per-token loop: a verl with its own chunked fallback, patches/0010, is left alone)."""
    from populora_verl import verl_compat

    res = finished(own_processes[INSTALL_CASES.index((mode, env, expect))])
    if verl_compat.has_chunked_logprobs():
        expect = "INSTALLED False False False True"
    assert expect in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


def test_the_engine_path_runs_the_patched_function(own_processes):
    """verl's FSDP engine calls the name it imported; after install() that name is ours (a call through the module
    global, as the engine makes it, returns our float32 result)."""
    res = finished(own_processes["engine"])
    assert "DTYPE torch.float32" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


def test_backward_leaves_float32_logits_untouched():
    """The backward works in place on a copy of each chunk; with fp32 logits a plain .float() would alias them."""
    z = torch.randn(9, 17, dtype=torch.float32, requires_grad=True)
    before = z.detach().clone()
    out = lp.label_logprobs(z, torch.randint(0, 17, (9,)), chunk=4)
    out.sum().backward()
    torch.testing.assert_close(z.detach(), before, rtol=0, atol=0)
    assert z.grad is not None and torch.isfinite(z.grad).all()


def test_the_documented_ray_override_composes_into_rays_runtime_env():
    """Workers on other nodes do not inherit the shell: docs/verl-integration.md gives this override instead."""
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        cfg = compose(config_name="smoke_0.5b", overrides=[
            "actor_rollout_ref.model.path=/m", f"+ray_kwargs.ray_init.runtime_env.env_vars.{lp.ENV}=verl"])
    env = OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env)["env_vars"]
    assert env == {lp.ENV: "verl", "VLLM_DISABLE_COMPILE_CACHE": "0"}  # beside the recipes' own env var
