"""HF transformers + PEFT engine of the CPU driver: mixed-adapter generation and per-adapter REINFORCE updates.

One base model carries one named LoRA adapter per population *slot* (``slot0``, ``slot1``, ...). A member lives in
its slot; a child replaces its victim in the victim's slot. Generation runs every member in one batch through PEFT's
``adapter_names=`` (eval mode). An update activates one slot (``set_adapter``), so only that adapter's parameters
require grad and take part in the forward; the other adapters get no gradient (``zero_grad(set_to_none=True)``) and
their AdamW never steps, so they stay bit-identical. Each slot has its own AdamW: no moment leaks between members.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from populora_verl.local.config import LocalConfig
from populora_verl.step import GenRequest, GenResponse, Sample

__all__ = ["HFEngine", "slot_name", "seed_for"]


def slot_name(slot: int) -> str:
    return f"slot{slot}"


def seed_for(seed: int, step: int, phase: int) -> int:
    """Generation seed of one phase of one step: generation replays exactly after a resume, whatever ran before."""
    return (int(seed) * 1_000_003 + int(step) * 101 + int(phase)) % (2**63 - 1)


@dataclass
class _Row:
    request_index: int
    slot: str
    prompt_ids: list[int]


class HFEngine:
    """Generation and training of a population of LoRA adapters on one HF causal LM."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        num_slots: int,
        cfg: LocalConfig,
        *,
        temperature: float = 1.0,
        max_new_tokens: int = 32,
        shared_a: bool = False,
    ) -> None:
        from peft import LoraConfig, get_peft_model

        self.cfg = cfg
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        self.temperature = float(temperature)
        self.max_new_tokens = int(max_new_tokens)
        self.lora_config = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=0.0,
            target_modules=list(cfg.lora_target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.slots = [slot_name(i) for i in range(num_slots)]
        # PEFT initialises B=0: every founder starts at the base model (lora_A draws from the global torch RNG,
        # which the driver seeds before building the engine).
        self.model = get_peft_model(model, self.lora_config, adapter_name=self.slots[0])
        for s in self.slots[1:]:
            self.model.add_adapter(s, self.lora_config)
        self.model.eval()
        self._params: dict[str, dict[str, torch.nn.Parameter]] = {s: self._slot_params(s) for s in self.slots}
        self._optim: dict[str, torch.optim.Optimizer] = {}
        if shared_a:  # population.founder_init=shared_a: every founder takes slot 0's lora_A (B is zero anyway)
            first = self.get_adapter(self.slots[0])
            for s in self.slots[1:]:
                self.set_adapter(s, first)

    # --- adapters -----------------------------------------------------------------------------------------

    def lora_config_dict(self) -> dict[str, Any]:
        return {
            "r": self.cfg.lora_r,
            "lora_alpha": self.cfg.lora_alpha,
            "target_modules": list(self.cfg.lora_target_modules),
            "lora_dropout": 0.0,
            "bias": "none",
            "task_type": "CAUSAL_LM",
        }

    def _slot_params(self, slot: str) -> dict[str, torch.nn.Parameter]:
        """``{contract key: parameter}``: PEFT names ``...q_proj.lora_A.<slot>.weight`` ->
        ``...q_proj.lora_A.weight``."""
        out = {}
        tag = f".{slot}."
        for name, p in self.model.named_parameters():
            if tag in name and (".lora_A." in name or ".lora_B." in name):
                out[name.replace(tag, ".")] = p
        if not out:
            raise ValueError(f"adapter {slot!r} has no LoRA parameters (target_modules={self.cfg.lora_target_modules})")
        return out

    def get_adapter(self, slot: str) -> dict[str, torch.Tensor]:
        """A detached copy of the slot's LoRA state dict (contract keys, no adapter name)."""
        return {k: p.detach().clone() for k, p in self._params[slot].items()}

    @torch.no_grad()
    def set_adapter(self, slot: str, state: Mapping[str, torch.Tensor]) -> None:
        params = self._params[slot]
        missing, extra = set(params) - set(state), set(state) - set(params)
        if missing or extra:
            raise ValueError(f"adapter for {slot}: missing keys {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
        for k, p in params.items():
            if tuple(state[k].shape) != tuple(p.shape):
                raise ValueError(
                    f"adapter for {slot}: {k} has shape {tuple(state[k].shape)}, expected {tuple(p.shape)}"
                )
            p.copy_(state[k].to(p.dtype))

    # --- optimizers ---------------------------------------------------------------------------------------

    def optimizer(self, slot: str) -> torch.optim.Optimizer:
        if slot not in self._optim:
            self._optim[slot] = torch.optim.AdamW(
                list(self._params[slot].values()),
                lr=self.cfg.lr,
                betas=tuple(self.cfg.betas),
                weight_decay=self.cfg.weight_decay,
            )
        return self._optim[slot]

    def reset_optimizer(self, slot: str) -> None:
        self._optim.pop(slot, None)

    def optimizer_state(self, slot: str) -> dict[str, Any]:
        return self.optimizer(slot).state_dict()

    def load_optimizer_state(self, slot: str, state: Mapping[str, Any]) -> None:
        """Give ``slot`` its own copy of ``state``: torch's ``load_state_dict`` keeps tensors that already have the
        parameter's dtype and device, so another slot's live ``state_dict()`` would share (and step) its moments."""
        self.reset_optimizer(slot)
        self.optimizer(slot).load_state_dict(copy.deepcopy(dict(state)))

    # --- generation ---------------------------------------------------------------------------------------

    def _encode(self, prompt: Any) -> list[int]:
        from populora_verl.tasks.prompts import encode_prompt

        return encode_prompt(self.tokenizer, prompt)[-self.cfg.max_prompt_tokens :]

    @torch.no_grad()
    def generate(self, requests: Sequence[GenRequest], slot_of: Callable[[str], str], seed: int) -> list[GenResponse]:
        """Answer every request ``n`` times; rows of all adapters share batches (``adapter_names=``)."""
        rows: list[_Row] = []
        for i, req in enumerate(requests):
            ids = self._encode(req.prompt)
            rows.extend(_Row(i, slot_of(req.adapter), ids) for _ in range(req.n))
        texts: list[list[str]] = [[] for _ in requests]
        extra: list[list[Any]] = [[] for _ in requests]
        lengths: list[list[int]] = [[] for _ in requests]
        from populora_verl.stop_tokens import stop_token_ids

        stops = stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        pad = self.tokenizer.pad_token_id
        self.model.eval()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(rows), self.cfg.gen_batch_size):
                batch = rows[start : start + self.cfg.gen_batch_size]
                width = max(len(r.prompt_ids) for r in batch)
                input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
                attn = torch.zeros((len(batch), width), dtype=torch.long)
                for j, r in enumerate(batch):
                    if r.prompt_ids:
                        input_ids[j, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
                        attn[j, width - len(r.prompt_ids) :] = 1
                sample = self.temperature > 0
                kwargs: dict[str, Any] = dict(
                    do_sample=sample, max_new_tokens=self.max_new_tokens, pad_token_id=pad, eos_token_id=stops
                )
                if sample:
                    kwargs.update(temperature=self.temperature, top_p=self.cfg.top_p, top_k=0)
                out = self.model.generate(
                    input_ids=input_ids, attention_mask=attn, adapter_names=[r.slot for r in batch], **kwargs
                )
                for j, r in enumerate(batch):
                    resp = out[j, width:].tolist()
                    end = next((k for k, t in enumerate(resp) if t in stops), None)
                    if end is not None:  # keep the stop token: ending is an action the policy is trained on
                        resp = resp[: end + 1]
                    texts[r.request_index].append(self.tokenizer.decode(resp, skip_special_tokens=True))
                    extra[r.request_index].append((r.prompt_ids, resp))
                    lengths[r.request_index].append(max(1, len(resp)))
        return [GenResponse(req, texts[i], lengths=lengths[i], extra=extra[i]) for i, req in enumerate(requests)]

    # --- training -----------------------------------------------------------------------------------------

    def update(self, slot: str, samples: Sequence[Sample]) -> dict[str, float]:
        """One REINFORCE step of ``slot`` on ``samples``: loss = -mean over response tokens of A * log pi."""
        samples = [s for s in samples if s.extra is not None and len(s.extra[1]) > 0]
        if not samples:
            return {"loss": 0.0, "tokens": 0.0, "grad_norm": 0.0}
        self.model.set_adapter(slot)  # only this slot is active and requires grad
        params = list(self._params[slot].values())
        opt = self.optimizer(slot)
        opt.zero_grad(set_to_none=True)
        total_tokens = sum(len(s.extra[1]) for s in samples)
        loss_total = 0.0
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(samples), self.cfg.micro_batch_size):
            mb = samples[start : start + self.cfg.micro_batch_size]
            seqs = [list(s.extra[0]) + list(s.extra[1]) for s in mb]
            width = max(len(x) for x in seqs)
            input_ids = torch.full((len(mb), width), pad, dtype=torch.long)
            attn = torch.zeros((len(mb), width), dtype=torch.long)
            resp_mask = torch.zeros((len(mb), width), dtype=torch.float32)
            adv = torch.zeros((len(mb), width), dtype=torch.float32)
            for j, (s, x) in enumerate(zip(mb, seqs)):
                off = width - len(x)
                input_ids[j, off:] = torch.tensor(x)
                attn[j, off:] = 1
                r0 = off + len(s.extra[0])
                resp_mask[j, r0:] = 1.0
                adv[j, r0:] = float(s.advantage)
            position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids).logits.float()
            # token t is predicted by position t-1
            logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
            mask, a = resp_mask[:, 1:], adv[:, 1:]
            loss = -(a * logp * mask).sum() / total_tokens
            loss.backward()
            loss_total += float(loss.detach())
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
            if self.cfg.grad_clip > 0
            else torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in params if p.grad is not None))
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"loss": loss_total, "tokens": float(total_tokens), "grad_norm": float(grad_norm)}
