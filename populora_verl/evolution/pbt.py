"""Population-based training: every ``interval_steps``, replace each sub-population's weakest members with
operator children of its survivors.

Two phases, so a trainer can log, broadcast or checkpoint the decision before any weights move:

1. :meth:`PBTController.plan` (pure decision, no tensors): per sub-population (``cfg.roles``), rank by fitness,
   pick victims ``bottom clamp(floor(N * cull_fraction), 1, N - 1)`` (never the ``protect_top`` fittest, never a
   member younger than ``min_age`` steps: the lowest-ranked old-enough members die instead), and for
   each victim draw a kind (crossover with prob. ``crossover_rate`` when two survivors exist), an operator of that
   kind (``cfg.operators`` weights, uniform if null), parents uniformly from the survivors (ordered fittest
   first), and an integer seed for the child.
2. :meth:`PBTController.apply`: run the operators (``torch.Generator`` seeded from the plan, parents cloned so a
   buggy operator cannot touch a survivor) and update the population: victims die, children take their slots
   with fresh ratings and lineage records.

Events fall on steps ``E, 2E, ...`` except in the run's last ``final_quiet_steps`` steps (default: one interval),
so every member of the final population has trained at least that long (:meth:`PBTController.due`).

Deterministic under ``seed``; ``state_dict()`` / ``load_state_dict()`` carry the RNG exactly.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from populora_verl.config import OPERATOR_KINDS as KINDS
from populora_verl.config import ROOT, ConfigError, PBTConfig, PopulationConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from populora_verl.population.members import Population

__all__ = ["Replacement", "EvolutionPlan", "PBTController", "num_victims"]

log = logging.getLogger(__name__)

_MAX_SEED = 2**63 - 1


def num_victims(n: int, cull_fraction: float, protect_top: int = 0) -> int:
    """How many of ``n`` members die: ``clamp(floor(n * cull), 1, n - 1)``, never one of the ``protect_top`` best.

    0 when ``n < 2`` (nobody to breed from) or when everybody is protected.
    """
    if n < 2:
        return 0
    k = min(max(math.floor(n * cull_fraction), 1), n - 1)
    return max(0, min(k, n - protect_top))


@dataclass
class Replacement:
    """One victim replaced by one child. ``parent_ids`` are ordered fittest first (the operator contract)."""

    victim_id: str
    victim_slot: int
    child_id: str
    role: str
    operator: str
    kind: str
    parent_ids: tuple[str, ...]
    params: dict[str, Any]
    seed: int
    reset_optimizer: bool = True
    # The victim's fitness equals a survivor's: the random tie order, not the fitness, chose it (e.g. every rating
    # still the prior). Reported with the event so a cull is never read as a judgement it was not.
    tie_break: bool = False


@dataclass
class EvolutionPlan:
    """The replacements of one evolution event, plus notes on sub-populations that could not evolve."""

    step: int
    replacements: list[Replacement] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fitness: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.replacements)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view (for logs and the lineage file)."""
        d = asdict(self)
        for r in d["replacements"]:
            r["parent_ids"] = list(r["parent_ids"])
        return d


def append_event(run_dir: str | os.PathLike, plan: EvolutionPlan) -> None:
    """Append one event to ``<run_dir>/evolution.jsonl`` (the plots' and the report's record of evolution)."""
    path = Path(run_dir) / "evolution.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(plan.to_dict()) + "\n")


def trim_events(run_dir: str | os.PathLike, step: int) -> None:
    """Drop events after ``step`` from ``<run_dir>/evolution.jsonl``, like the metrics log: steps redone after
    resuming from checkpoint ``step`` (or a fresh start over a run killed before its first checkpoint) must not log
    their events twice. A half-written last line of a killed run goes too."""
    path = Path(run_dir) / "evolution.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event_step = int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError, TypeError):
            continue
        if event_step <= step:
            kept.append(line + "\n")
    from populora_verl.fsutil import write_text_atomic

    write_text_atomic(path, "".join(kept))


def describe(r: Replacement) -> str:
    """One log line's worth of a replacement."""
    return f"{r.victim_id} (slot {r.victim_slot}) <- {r.child_id} = {r.operator}({', '.join(r.parent_ids)})" + (
        " [tie-break: the victim's fitness equals a survivor's]" if r.tie_break else ""
    )


class PBTController:
    """Decides and applies evolution events. ``operators`` defaults to the ``OPERATORS`` registry."""

    def __init__(
        self,
        cfg: PBTConfig | None = None,
        seed: int = 0,
        operators: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
    ) -> None:
        self.cfg = cfg if cfg is not None else PBTConfig()
        self.seed = int(seed)
        # The run's last step (CPU driver: --steps; verl: trainer.total_training_steps); None: unknown, so the
        # final quiet window cannot be placed and every due step evolves.
        self.total_steps = None if total_steps is None else int(total_steps)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        if operators is None:
            from populora_verl.evolution.operators import OPERATORS  # torch-heavy: only when a controller exists

            operators = OPERATORS
        self.operators = operators
        self._weights = self._operator_weights()
        self._params = self._operator_params()

    # --- configuration ------------------------------------------------------------------------------------

    @property
    def _key(self) -> str:
        return getattr(self.cfg, "_prefix", f"{ROOT}.pbt")

    def _operator_weights(self) -> dict[str, dict[str, float]]:
        """``{kind: {name: probability weight}}`` from ``cfg.operators`` (uniform over the registry if null)."""
        chosen = self.cfg.operators if self.cfg.operators is not None else {n: 1.0 for n in self.operators}
        out: dict[str, dict[str, float]] = {k: {} for k in KINDS}
        for name, w in chosen.items():
            if name not in self.operators:
                raise ConfigError(f"{self._key}.operators.{name}: unknown operator; known: {sorted(self.operators)}")
            kind = self.operators[name].kind
            if kind not in KINDS:
                raise ConfigError(f"{self._key}.operators.{name}: operator kind {kind!r} is not one of {KINDS}")
            if w > 0:
                out[kind][name] = float(w)
        return out

    def _accepted_params(self, name: str) -> set[str]:
        op = self.operators[name]
        accepted = set(getattr(op, "defaults", {}) or {})
        if not accepted:  # an operator without declared defaults: read its keyword-only parameters
            try:
                sig = inspect.signature(op)
            except (TypeError, ValueError):
                sig = None
            if sig is not None:
                accepted = {
                    p.name
                    for p in sig.parameters.values()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "generator"
                }
        return accepted

    def _operator_params(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name, params in (self.cfg.operator_params or {}).items():
            if name not in self.operators:
                raise ConfigError(
                    f"{self._key}.operator_params.{name}: unknown operator; known: {sorted(self.operators)}"
                )
            if not isinstance(params, Mapping):
                raise ConfigError(f"{self._key}.operator_params.{name}: must be a mapping of parameter -> value")
            accepted = self._accepted_params(name)
            for p in params:
                if p not in accepted:
                    raise ConfigError(
                        f"{self._key}.operator_params.{name}.{p}: {name} does not accept {p!r}; "
                        f"accepted: {sorted(accepted)}"
                    )
            out[name] = dict(params)
        return out

    def _kind_odds(self, survivors: int) -> tuple[float, float]:
        """(crossover, mutation) weights for a child given the number of survivors it can breed from."""
        p_cross = self.cfg.crossover_rate if (survivors >= 2 and self._weights["crossover"]) else 0.0
        p_mut = (1.0 - self.cfg.crossover_rate) if self._weights["mutation"] else 0.0
        return p_cross, p_mut

    def validate(self, population_config: PopulationConfig) -> None:
        """Start-up check that every sub-population can breed under this config (one-line ConfigError)."""
        if not self.cfg.enabled:  # the config turns evolution off for the single agent
            return
        sizes = {"teacher": population_config.num_teachers, "student": population_config.num_students}
        for role in self.cfg.roles:
            n = sizes[role]
            victims = num_victims(n, self.cfg.cull_fraction, self.cfg.protect_top)
            survivors = n - max(victims, 1)
            if self.cfg.crossover_rate == 1.0 and survivors < 2:
                raise ConfigError(
                    f"{self._key}.crossover_rate: 1.0 forces crossovers, which need 2 survivors, but the {role} "
                    f"sub-population ({n} members) leaves {max(survivors, 0)}; lower it, lower cull_fraction or "
                    f"use >= 3 {role}s"
                )
            if victims == 0:
                continue  # nobody is replaced in this sub-population: plan() notes it
            if n == 2:
                # Say it once at start-up: with two members every event is "replace the weaker by a child of the
                # stronger", so the role collapses to one lineage. Allowed (the 1T+1S-like ablations want it).
                log.warning(
                    "%s: the %s sub-population has 2 members, so every evolution event replaces one of "
                    "them (floor(2 x %s) clamped to 1) with a child of the other; drop %r from %s.roles to "
                    "keep both lineages",
                    self._key,
                    role,
                    self.cfg.cull_fraction,
                    role,
                    self._key,
                )
            p_cross, p_mut = self._kind_odds(survivors)
            if p_cross + p_mut > 0:
                continue
            missing = "crossover" if self.cfg.crossover_rate == 1.0 else "mutation"
            raise ConfigError(
                f"{self._key}.operators: no {missing} operator with a positive weight, but the {role} "
                f"sub-population ({n} members, {survivors} survivors) needs one"
            )

    # --- when ---------------------------------------------------------------------------------------------

    def in_final_quiet(self, step: int) -> bool:
        """True in the run's last ``final_quiet_steps`` steps (``total_steps`` must be known)."""
        return self.total_steps is not None and step > self.total_steps - self.cfg.quiet_steps

    def due(self, step: int) -> bool:
        """True on steps ``E, 2E, ...`` (never at step 0, before anybody has been rated), except in the final quiet
        window: a child born there would be evaluated untrained."""
        return (
            bool(self.cfg.enabled)
            and step > 0
            and step % self.cfg.interval_steps == 0
            and not self.in_final_quiet(step)
        )

    # --- deciding -----------------------------------------------------------------------------------------

    def _newborn(self, member: Any) -> bool:
        """A child (founders are never protected) that has trained fewer than ``min_age`` steps."""
        return bool(member.parents) and member.age < self.cfg.min_age

    def _pick(self, weights: Mapping[str, float]) -> str:
        names = list(weights)
        w = np.array([weights[n] for n in names], dtype=np.float64)
        return names[int(self._rng.choice(len(names), p=w / w.sum()))]

    def plan(
        self, population: Population, step: int, recent_rewards: Mapping[str, float] | None = None
    ) -> EvolutionPlan:
        """Decide who dies and how each child is made. Does not change the population."""
        fitness = population.fitness(self.cfg.fitness, recent_rewards)
        plan = EvolutionPlan(step=int(step), fitness=fitness)
        offsets: dict[str, int] = {}
        for role in self.cfg.roles:
            group = [m for m in population.members if m.role == role]
            n = len(group)
            if n < 2:
                plan.notes.append(f"{role}: sub-population of {n} cannot evolve (needs >= 2 members)")
                continue
            victims_n = num_victims(n, self.cfg.cull_fraction, self.cfg.protect_top)
            if victims_n == 0:
                plan.notes.append(f"{role}: protect_top={self.cfg.protect_top} protects all {n} members")
                continue
            # Best first; ties broken at random (e.g. at the start every rating is the prior).
            ties = self._rng.permutation(n)
            ranked = [
                m
                for _, _, m in sorted(
                    zip((-fitness[m.id] for m in group), ties.tolist(), group), key=lambda x: (x[0], x[1])
                )
            ]
            # Victims: the lowest-ranked members that are neither elite (protect_top) nor a newborn child (min_age).
            eligible = [m for m in ranked[self.cfg.protect_top :] if not self._newborn(m)]
            victims = eligible[len(eligible) - min(victims_n, len(eligible)) :] if eligible else []
            if len(victims) < victims_n:
                young = [m.id for m in group if self._newborn(m)]
                plan.notes.append(
                    f"{role}: {victims_n - len(victims)} fewer victims: {young} younger than min_age={self.cfg.min_age}"
                )
            if not victims:
                continue
            dead = {m.id for m in victims}
            survivors = [m for m in ranked if m.id not in dead]
            survivor_fitness = {fitness[m.id] for m in survivors}
            rank_of = {m.id: i for i, m in enumerate(ranked)}
            for victim in victims:
                p_cross, p_mut = self._kind_odds(len(survivors))
                if p_cross + p_mut <= 0:
                    raise ConfigError(
                        f"{self._key}.crossover_rate: no operator kind possible for the {role} "
                        f"sub-population ({len(survivors)} survivors); see PBTController.validate"
                    )
                kind = "crossover" if self._rng.random() * (p_cross + p_mut) < p_cross else "mutation"
                name = self._pick(self._weights[kind])
                k = 2 if kind == "crossover" else 1
                picked = [survivors[i] for i in self._rng.choice(len(survivors), size=k, replace=False).tolist()]
                parents = tuple(m.id for m in sorted(picked, key=lambda m: rank_of[m.id]))
                params = {**dict(getattr(self.operators[name], "defaults", {}) or {}), **self._params.get(name, {})}
                off = offsets.get(role, 0)
                offsets[role] = off + 1
                plan.replacements.append(
                    Replacement(
                        victim_id=victim.id,
                        victim_slot=victim.slot,
                        child_id=population.next_id(role, off),
                        role=role,
                        operator=name,
                        kind=kind,
                        parent_ids=parents,
                        params=params,
                        seed=int(self._rng.integers(0, _MAX_SEED)),
                        reset_optimizer=bool(self.cfg.reset_optimizer_on_replace),
                        tie_break=fitness[victim.id] in survivor_fitness,
                    )
                )
        return plan

    # --- applying -----------------------------------------------------------------------------------------

    def _child_rating(self, population: Population, r: Replacement) -> tuple[float | None, float | None]:
        if self.cfg.child_rating == "prior":
            return None, None
        # inherit_inflate_sigma: the fitter parent's mu; doubled sigma (more uncertain), never above the prior's.
        fitter = population.ratings[r.parent_ids[0]]
        return float(fitter.mu), float(min(2.0 * fitter.sigma, population.ratings.env.sigma))

    def apply(
        self, plan: EvolutionPlan, population: Population, adapters: Mapping[str, Mapping[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Make the children and update ``population``; returns ``{child_id: state_dict}``.

        All children are made before the population changes, so an operator error leaves it untouched. The
        caller puts each child into its victim's bank slot (``Replacement.victim_slot``) and resets that slot's
        optimizer state where ``reset_optimizer`` is set.
        """
        import torch

        self._check_victims(plan, population)
        for r in plan.replacements:
            for pid in r.parent_ids:
                if pid not in adapters:
                    raise KeyError(f"no adapter for parent {pid!r}")
        children: dict[str, dict[str, torch.Tensor]] = {}
        for r in plan.replacements:
            # Clones: an operator writing into its input must not corrupt a survivor's weights.
            parents = [{k: v.detach().clone() for k, v in adapters[pid].items()} for pid in r.parent_ids]
            generator = torch.Generator(device="cpu").manual_seed(r.seed)
            child = self.operators[r.operator](parents, generator=generator, **r.params)
            ref = adapters[r.parent_ids[0]]
            if set(child) != set(ref) or any(
                child[k].shape != ref[k].shape or child[k].dtype != ref[k].dtype for k in ref
            ):
                raise RuntimeError(f"operator {r.operator!r} changed the adapter's keys, shapes or dtypes")
            children[r.child_id] = child
        self.commit(plan, population)
        return children

    def commit(self, plan: EvolutionPlan, population: Population) -> None:
        """The population side of :meth:`apply` alone, for an engine that makes the children where the adapters live
        (the verl workers): victims die at ``plan.step``, children take their slots with their ratings and lineage.
        Call it once the children are in their slots, so that a failed write leaves the population as it was."""
        self._check_victims(plan, population)
        for r in plan.replacements:
            mu, sigma = self._child_rating(population, r)
            population.replace(r.victim_id, r.child_id, r.parent_ids, r.operator, plan.step, mu=mu, sigma=sigma)

    @staticmethod
    def _check_victims(plan: EvolutionPlan, population: Population) -> None:
        for r in plan.replacements:
            if not population.member(r.victim_id).alive:
                raise ValueError(f"stale plan: victim {r.victim_id!r} is already dead")

    # --- persistence --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._rng = np.random.Generator(np.random.PCG64())
        self._rng.bit_generator.state = dict(state["rng"])
