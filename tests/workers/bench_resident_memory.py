"""Trainer memory of resident adapters against the bank, through verl's FSDP engine code on the CPU.

The engine, model and loss are those of ``test_resident_verl_engine.py`` (a tiny PEFT Qwen2, verl's
``FSDPEngineWithLMHead``, ``ppo_loss``, dynamic micro-batching), with the model's sizes as arguments. Memory is
counted from the tensors (:mod:`populora_verl.bench.live_bytes`), not by an allocator: the bytes a call allocates
and keeps above what existed before it, at their peak, and per micro-batch the bytes autograd saves for backward
(activations, and older storages such as weights). The figures are deterministic: the same shapes give the same
bytes on any machine.

Arms, on the same rows, after one warm-up call each (AdamW's moments exist):

* ``bank``: one live PEFT adapter with the lean LoRA forward, each slot's rows in a call of its own, verl's balanced
  micro-batches;
* ``resident``: every slot resident, each slot's rows kept together in the micro-batches (the default);
* ``resident_verlmb``: every slot resident, verl's balanced micro-batches (``POPULORA_RESIDENT_MICRO_BATCHES=verl``);
* ``resident_full``: every slot resident, each slot's rows together, micro-batches packed full in order (the
  partition before the tokens were spread evenly over the same number of micro-batches).

Scenarios are the GPU A/B's row shapes scaled down by 100 (``--scale``): the single agent (one slot: 6 teacher rows of
16 tokens and 24 student rows of 12) and 4T4S (4 slots of 6 teacher rows, 4 of 24 student rows), with training
micro-batches of 164 tokens and log-prob micro-batches of 328 (16,384 and 32,768 on the GPU). ``--sweep`` varies the
model (hidden size, layers, vocabulary, LoRA rank) and the tokens with the whole batch in one micro-batch in both
arms, which separates what the resident code adds per micro-batch from what the partition adds::

    python tests/workers/bench_resident_memory.py
    python tests/workers/bench_resident_memory.py --sweep
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

import torch
from tensordict import TensorDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_resident_verl_engine as harness  # noqa: E402

from populora_verl.bench.live_bytes import LiveBytes, SavedBytes  # noqa: E402
from populora_verl.workers import lora_forward, resident_engine  # noqa: E402
from populora_verl.workers.resident_engine import MICRO_BATCH_ENV  # noqa: E402

MiB = 2**20
ARMS = ("bank", "resident", "resident_verlmb", "resident_full")


def rows(shapes: list[tuple[int, int]], vocab: int, seed: int = 5) -> TensorDict:
    """Rows as verl's trainer holds them (left-padded prompts, right-padded responses) of the given
    ``(prompt, response)`` token counts."""
    g = torch.Generator().manual_seed(seed)
    n, pw, rw = len(shapes), max(p for p, _ in shapes), max(r for _, r in shapes)
    prompts = torch.zeros(n, pw, dtype=torch.long)
    responses = torch.zeros(n, rw, dtype=torch.long)
    attn = torch.zeros(n, pw + rw, dtype=torch.long)
    for i, (p, r) in enumerate(shapes):
        prompts[i, pw - p :] = torch.randint(1, vocab, (p,), generator=g)
        responses[i, :r] = torch.randint(1, vocab, (r,), generator=g)
        attn[i, pw - p : pw + r] = 1
    mask = attn[:, pw:].clone()
    return TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn,
            "response_mask": mask,
            "position_ids": (attn.cumsum(-1) - 1).clamp_min(0),
            "old_log_probs": -torch.rand(n, rw, generator=g) * mask,
            "advantages": torch.randn(n, 1, generator=g).expand(n, rw) * mask,
        },
        batch_size=[n],
    )


def scenario(name: str, scale: float) -> list[tuple[int, list[tuple[int, int]]]]:
    """``[(slot, row shapes)]``: the GPU A/B's rows (teacher 571 + 1,024 tokens, student 218 + 1,024) over ``scale``."""
    teacher = (round(571 / scale), round(1024 / scale))
    student = (round(218 / scale), round(1024 / scale))
    if name == "single":
        return [(0, [teacher] * 6 + [student] * 24)]
    if name == "4t4s":
        return [(k, [teacher] * 6) for k in range(4)] + [(k, [student] * 24) for k in range(4, 8)]
    raise ValueError(name)


class Probe:
    """Per micro-batch of one engine call: its tokens, the peak live bytes from its forward to the next micro-batch
    (its backward included) and the bytes its forward saved for backward."""

    def __init__(self, eng) -> None:
        self.live = LiveBytes()
        self.saved = SavedBytes(self.live)
        self.micro: list[dict[str, int]] = []
        self._fs, self._os = eng.forward_step, eng.optimizer_step
        eng.forward_step = self._forward_step
        eng.optimizer_step = self._optimizer_step
        self.eng = eng

    def _close(self) -> None:
        self.peak = max(self.peak, self.live.peak - self.start)
        if self.micro and "peak" not in self.micro[-1]:
            self.micro[-1]["peak"] = self.live.peak - self.start
            self.micro[-1]["saved_act"] = self.saved.activations
            self.micro[-1]["saved_other"] = self.saved.other

    def _forward_step(self, micro_batch, *args, **kwargs):
        self._close()
        self.live.reset_peak()
        self.saved.reset()
        self.micro.append({"tokens": int(micro_batch["input_ids"].offsets()[-1])})
        with self.saved():
            return self._fs(micro_batch, *args, **kwargs)

    def _optimizer_step(self):
        self._close()
        return self._os()

    @contextlib.contextmanager
    def call(self):
        """Counts one engine call: ``peak`` (bytes above what was live when it started) and ``micro``."""
        self.micro = []
        with self.live:
            self.live.reset_peak()
            self.start, self.peak = self.live.live, 0
            yield self
            self._close()

    def undo(self) -> None:
        self.eng.forward_step, self.eng.optimizer_step = self._fs, self._os


EVEN = resident_engine.slot_partitions


def packed_full(slots, lengths, max_tokens, count=0):
    """Rows in slot order, each micro-batch filled up to ``max_tokens`` before the next starts."""
    even = EVEN(slots, lengths, max_tokens, count)
    order = [i for part in even for i in part]
    parts = resident_engine._pack([lengths[i] for i in order], max_tokens)
    return even if len(parts) != len(even) else [[order[i] for i in part] for part in parts]


def run_arm(arm: str, plan, dims: dict[str, int], train_tokens: int, logp_tokens: int) -> dict:
    """The arm's update and log-prob pass over every slot's rows; peaks in bytes, micro-batches of each."""
    harness.SLOTS = max(k for k, _ in plan) + 1
    resident = arm != "bank"
    os.environ[MICRO_BATCH_ENV] = "verl" if arm == "resident_verlmb" else "slot"
    lora_forward.install("lean" if arm == "bank" else "peft")
    eng, store = harness.verl_engine(resident, **dims)
    resident_engine.slot_partitions = packed_full if arm == "resident_full" else EVEN
    harness.MAX_TOKENS = train_tokens

    def batch(k_rows, slots, budget):
        td = harness.actor_batch(k_rows, slots, jagged=True)
        harness.tu.assign_non_tensor(td, max_token_len_per_gpu=budget)
        return td

    if resident:
        shapes = [s for _, ss in plan for s in ss]
        slots = [k for k, ss in plan for _ in ss]
        calls = [(None, rows(shapes, dims["vocab"]), slots)]
    else:
        calls = [(k, rows(ss, dims["vocab"], seed=5 + k), None) for k, ss in plan]
    out = {"update": 0, "logp": 0, "update_micro": [], "logp_micro": []}
    # one adapter's LoRA weights (the bank's live adapter or slot 0): the per-parameter scale of the differences
    out["adapter_bytes"] = sum(p.numel() * p.element_size() for p in (store._params.values() if not resident
                                                                       else store.slot_parameters(0)))
    probe = Probe(eng)
    for phase in ("update", "logp"):
        for measured in (False, True):  # a warm-up call first: AdamW's moments exist before the measured one
            for k, data, slots in calls:
                ctx = store.active(k, train=phase == "update") if k is not None else contextlib.nullcontext()
                with ctx:
                    # gradients a step left behind (verl's optimizer keeps them until the next zero_grad, the
                    # resident one drops them) go before the count starts, so both arms start from the same state
                    eng.optimizer_zero_grad()
                    with probe.call():
                        if phase == "update":
                            eng.train_batch(batch(data, slots, train_tokens), loss_function=harness.loss_fn())
                        else:
                            eng.infer_batch(batch(data, slots, logp_tokens))
                if measured:
                    out[phase] = max(out[phase], probe.peak)
                    out[f"{phase}_micro"] += probe.micro
    probe.undo()
    resident_engine.slot_partitions = EVEN
    lora_forward.uninstall()
    return out


def show(name: str, plan, dims, train_tokens: int, logp_tokens: int) -> dict[str, dict]:
    res = {arm: run_arm(arm, plan, dims, train_tokens, logp_tokens) for arm in ARMS}
    total = sum(p + r for _, ss in plan for p, r in ss)
    print(f"\n{name}: {len(plan)} slot(s), {total} tokens, "
          f"micro-batches of {train_tokens} / {logp_tokens} tokens, {dims}")
    print(f"{'arm':16s} {'update peak MiB':>16s} {'log-prob peak MiB':>18s}  train micro-batch tokens / log-prob")
    for arm, r in res.items():
        tm = [m["tokens"] for m in r["update_micro"]]
        lm = [m["tokens"] for m in r["logp_micro"]]
        print(f"{arm:16s} {r['update'] / MiB:16.3f} {r['logp'] / MiB:18.3f}  {tm} / {lm}")
    print("per training micro-batch: tokens, saved activations KiB, saved activations bytes per token, peak KiB "
          "(from its forward\nto the next micro-batch's, over what was live before the call)")
    for arm, r in res.items():
        parts = [
            f"{m['tokens']}: {m['saved_act'] / 1024:.0f}, {m['saved_act'] / m['tokens']:.0f}, {m['peak'] / 1024:.0f}"
            for m in r["update_micro"]
        ]
        print(f"  {arm:16s} " + "; ".join(parts))
    return res


def sweep(scale: float) -> None:
    """Bank and resident with the same micro-batch (the whole batch) over model sizes and token counts: what the
    resident code adds per micro-batch, against what grows with tokens, vocabulary, width and depth."""
    base = {"vocab": 1024, "hidden": 64, "intermediate": 96, "layers": 2, "rank": 8}
    cases = [
        ("base", base, 1),
        ("2x tokens", base, 2),
        ("4x vocab", {**base, "vocab": 4096}, 1),
        ("2x hidden", {**base, "hidden": 128, "intermediate": 192}, 1),
        ("2x layers", {**base, "layers": 4}, 1),
        ("2x rank", {**base, "rank": 16}, 1),
    ]
    print("\none micro-batch in both arms; resident minus bank, and the bank's bytes per token")
    print(f"{'case':10s} {'tokens':>6s} {'bank upd MiB':>12s} {'res - bank upd KiB':>19s} {'bank logp MiB':>13s} "
          f"{'res - bank logp KiB':>20s} {'saved act B/token bank':>22s} {'res - bank':>10s} {'adapter KiB':>11s}")
    for name, dims, mult in cases:
        plan = [(k, ss * mult) for k, ss in scenario("single", scale)]
        res = {arm: run_arm(arm, plan, dims, 10**6, 10**6) for arm in ("bank", "resident_verlmb")}
        b, r = res["bank"], res["resident_verlmb"]
        tokens = sum(m["tokens"] for m in b["update_micro"])
        sb = sum(m["saved_act"] for m in b["update_micro"]) / tokens
        sr = sum(m["saved_act"] for m in r["update_micro"]) / tokens
        print(f"{name:10s} {tokens:6d} {b['update'] / MiB:12.3f} {(r['update'] - b['update']) / 1024:19.1f} "
              f"{b['logp'] / MiB:13.3f} {(r['logp'] - b['logp']) / 1024:20.1f} {sb:22.0f} {sr - sb:10.0f} "
              f"{r['adapter_bytes'] / 1024:11.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=100.0, help="the GPU's row lengths and budgets over this")
    ap.add_argument("--sweep", action="store_true", help="model and token sweep with the same micro-batches")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()

    with harness.cpu_rank(tempfile.mktemp()):
        print(f"torch {torch.__version__}; bytes counted from tensors (deterministic), fp32 model on the CPU")
        train_tokens, logp_tokens = round(16384 / args.scale), round(32768 / args.scale)
        dims = {"vocab": args.vocab, "hidden": args.hidden, "intermediate": args.hidden * 3 // 2, "layers": args.layers,
                "rank": 8}
        if args.sweep:
            sweep(args.scale)
        else:
            for name in ("single", "4t4s"):
                show(name, scenario(name, args.scale), dims, train_tokens, logp_tokens)


if __name__ == "__main__":
    main()
