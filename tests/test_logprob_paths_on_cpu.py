"""populora_verl.bench.logprob_paths: verl's per-token log-prob fallback against vectorised paths (issue 12)."""

from __future__ import annotations

import pytest
import torch

from populora_verl.bench import logprob_paths as lp


def test_every_path_agrees_with_the_others_and_is_timed():
    times = lp.run(tokens=64, vocab=97, hidden=16, rounds=2, device="cpu", dtype=torch.float32)
    assert set(times) == set(lp.PATHS) and all(len(v) == 2 and min(v) > 0 for v in times.values())
    text = lp.report(times, 64, "cpu")
    assert lp.actor_uses_flash_ce() is False  # no flash_attn package here (nor in our GPU bundle)
    assert "| verl_fallback |" in text and text.count("| 1.000 |") == 1  # the fallback is the reference


def test_the_fallback_loops_once_per_token(monkeypatch):
    """The diagnosis the bench rests on: verl's fallback calls a per-row op once per packed token."""
    from verl.utils import torch_functional as verl_F

    calls = {"n": 0}
    real = torch.nn.functional.log_softmax

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(verl_F.F, "log_softmax", counting)
    logits = torch.randn(37, 11, dtype=torch.bfloat16)
    verl_F.logprobs_from_logits_v2(logits, torch.randint(0, 11, (37,)))
    assert calls["n"] == 37


def test_paths_disagreeing_is_an_error(monkeypatch):
    monkeypatch.setitem(lp.PATHS, "vectorised", lambda h, w, y: lp._vectorised(h, w, y) + 1.0)
    with pytest.raises(AssertionError):
        lp.run(tokens=8, vocab=13, hidden=4, rounds=1, device="cpu", dtype=torch.float32)


def test_cli_rejects_unknown_paths_and_bad_sizes():
    with pytest.raises(SystemExit):
        lp.main(["--paths", "nope"])
    with pytest.raises(SystemExit):
        lp.main(["--tokens", "0"])
