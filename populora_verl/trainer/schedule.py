"""A population schedule: one trainer process runs several population configurations one after another.

``+trainer.populora_population_schedule='[{"name": "single", "steps": 6, "population": {"mode": "single_agent"}},
{"name": "4t4s", "steps": 6, "population": {"num_teachers": 4, "num_students": 4}}]'`` (JSON) makes the trainer
start with the first entry's ``populora.population`` and, at the first step of each later entry, replace the
population, the adapter bank (fresh adapters and optimizer state) and vLLM's adapters, keeping Ray, the FSDP engine
and the vLLM engine. The step benchmark uses it to pay start-up once for all configurations
(:mod:`populora_verl.bench.step_scaling`); a learning run has no use for it. ``trainer.total_training_steps`` must
equal the entries' total.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from populora_verl.config import ConfigError

__all__ = ["SCHEDULE_KEY", "Entry", "parse_schedule", "starts", "entry_at", "entry_config", "scheduled_configs"]

SCHEDULE_KEY = "trainer.populora_population_schedule"


@dataclass(frozen=True)
class Entry:
    name: str
    steps: int
    population: dict[str, Any] = field(default_factory=dict)


def _bad(msg: str) -> ConfigError:
    return ConfigError(f"{SCHEDULE_KEY}: {msg}")


def parse_schedule(raw: Any, total_steps: int | None = None) -> list[Entry]:
    """Entries from the JSON string (or an already-parsed list); ``[]`` when unset. Fails with one line naming the
    key on anything malformed, or when the steps do not add up to ``total_steps``."""
    if raw is None or raw == "" or raw == []:
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise _bad(f"not JSON ({e})") from None
    if not isinstance(raw, (list, tuple)) or not raw:
        raise _bad("expected a non-empty list of {name, steps, population}")
    out, names = [], set()
    for i, e in enumerate(raw):
        if not isinstance(e, Mapping):
            raise _bad(f"entry {i} is not a mapping")
        name = str(e.get("name") or f"entry{i}")
        steps = e.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise _bad(f"entry {name!r}: steps must be an integer >= 1, got {steps!r}")
        pop = e.get("population") or {}
        if not isinstance(pop, Mapping):
            raise _bad(f"entry {name!r}: population must be a mapping of populora.population keys")
        if name in names:
            raise _bad(f"entry name {name!r} appears twice")
        names.add(name)
        out.append(Entry(name, steps, dict(pop)))
    if total_steps is not None and sum(e.steps for e in out) != int(total_steps):
        raise _bad(
            f"entries add up to {sum(e.steps for e in out)} steps but trainer.total_training_steps is {total_steps}"
        )
    return out


def starts(schedule: list[Entry]) -> dict[int, int]:
    """``{first global step (1-based): entry index}``."""
    out, step = {}, 1
    for i, e in enumerate(schedule):
        out[step] = i
        step += e.steps
    return out


def entry_at(schedule: list[Entry], global_step: int) -> tuple[int, int] | None:
    """``(entry index, step within the entry, 1-based)`` of a global step, or ``None`` past the end."""
    step = 1
    for i, e in enumerate(schedule):
        if global_step < step + e.steps:
            return (i, global_step - step + 1) if global_step >= step else None
        step += e.steps
    return None


def entry_config(config: Any, entry: Entry) -> Any:
    """The run's ``populora`` with the entry's ``population`` keys, validated like the run's own configuration
    (``PopuLoRAConfig``; errors name the entry)."""
    from omegaconf import OmegaConf

    from populora_verl.config import load_config
    from populora_verl.trainer.verl_config import validate_verl_config

    base = OmegaConf.to_container(config.get("populora"), resolve=True) or {}
    base["population"] = {**(base.get("population") or {}), **entry.population}
    try:
        pcfg = load_config(base)
        validate_verl_config(config, pcfg)
    except ConfigError as e:
        raise ConfigError(f"{SCHEDULE_KEY} entry {entry.name!r}: {e}") from None
    return pcfg


def scheduled_configs(config: Any) -> tuple[list[Entry], list[Any]]:
    """The schedule of a composed verl config and each entry's ``PopuLoRAConfig`` (``[], []`` when unset)."""
    from omegaconf import OmegaConf

    entries = parse_schedule(
        OmegaConf.select(config, SCHEDULE_KEY, default=None),
        OmegaConf.select(config, "trainer.total_training_steps", default=None),
    )
    return entries, [entry_config(config, e) for e in entries]


def switch_population(trainer: Any, idx: int) -> None:
    """At the step where schedule entry ``idx`` starts (a benchmark's population schedule, never a training run's):
    replace the trainer's population, the adapter bank and vLLM's adapters; keep Ray, FSDP and the vLLM engine.

    Mirrors a step boundary: replicas asleep, fresh bank on the workers, every slot pushed under its id (same
    ids as the previous entry's slots of the same number: the registry updates them in place)."""
    from populora_verl.step import PopulationStep

    entry, old = trainer._schedule[idx], trainer.pop_step
    trainer.checkpoint_manager.sleep_replicas()
    trainer.pcfg = trainer._schedule_cfgs[idx]
    trainer.pop_step = PopulationStep(trainer.pcfg, executor=old.tasks.executor)
    trainer.pop_step.updates_per_step = getattr(old, "updates_per_step", 1)  # the compute metrics count it
    trainer._phase = None
    info = trainer._rpc(
        "populora_init_bank",
        trainer.pcfg.population.num_adapters,
        trainer.pcfg.population.seed,
        layout=trainer.pcfg.population.adapter_layout,
    )
    trainer.checkpoint_manager.update_weights(trainer.global_steps)
    print(
        f"[populora] step {trainer.global_steps}: population schedule entry {entry.name!r} "
        f"({info['num_slots']} adapters)",
        flush=True,
    )
