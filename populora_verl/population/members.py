"""Population members, their lineage, and the population object the trainer and the CPU driver share.

Ids: teachers ``t0, t1, ...``, students ``s0, s1, ...``, the single agent ``a0`` (role ``both``). A child gets the
next unused number of its role, so an id is never reused and the lineage is unambiguous. ``slot`` is the
adapter-bank slot; a child takes its victim's slot, so the bank never grows.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from populora_verl.population.ratings import Ratings
from populora_verl.population.state import POPULATION_FILE, read_population_state, save_population

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from populora_verl.config import PopuLoRAConfig

__all__ = ["ROLES", "ROLE_PREFIX", "Member", "Population"]

ROLES = ("teacher", "student", "both")
ROLE_PREFIX = {"teacher": "t", "student": "s", "both": "a"}
_ID_RE = re.compile(r"^([tsa])(\d+)$")


@dataclass
class Member:
    """One adapter, alive or dead. ``parents`` are ordered fittest first (empty for the founders)."""

    id: str
    role: str
    slot: int
    parents: tuple[str, ...] = ()
    operator: str | None = None
    birth_step: int = 0
    generation: int = 0
    death_step: int | None = None
    # Rating when the member died, kept so the lineage tells how good the replaced members were.
    final_mu: float | None = None
    final_sigma: float | None = None
    # Population steps this member has been trained in (0 at birth); a child needs some before it has recovered
    # from its operator, so selection (pbt.min_age) and evaluation (Population.young) read it.
    age: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"member {self.id!r}: role must be one of {list(ROLES)}, got {self.role!r}")
        m = _ID_RE.match(self.id)
        if m is None or m.group(1) != ROLE_PREFIX[self.role]:
            raise ValueError(
                f"member id {self.id!r} does not match role {self.role!r} (expected {ROLE_PREFIX[self.role]}<number>)"
            )
        self.parents = tuple(self.parents)

    @property
    def alive(self) -> bool:
        return self.death_step is None

    @property
    def number(self) -> int:
        return int(self.id[1:])

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["parents"] = list(self.parents)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Member:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"member record has unknown fields {sorted(unknown)}")
        return cls(**{**d, "parents": tuple(d.get("parents", ()))})


class Population:
    """Members (alive and dead), their TrueSkill ratings and the current step.

    ``members`` lists the alive members ordered by slot; ``lineage`` holds every member ever, in birth order.
    ``states`` holds the component states (matchmaker / PBT RNGs) read by :meth:`load`; :meth:`save` writes only
    the ``states=`` it is given.
    """

    def __init__(self, ratings: Ratings, mode: str = "population") -> None:
        if mode not in ("population", "single_agent"):
            raise ValueError(f"mode must be 'population' or 'single_agent', got {mode!r}")
        self.mode = mode
        self.ratings = ratings
        self.step = 0
        self._lineage: dict[str, Member] = {}
        self.states: dict[str, Any] = {}
        self.lora_config: dict[str, Any] | None = None
        # Members younger than this many steps have not recovered from their operator (pbt.final_quiet_steps):
        # evaluation and the report flag them. None: unknown (no PBT).
        self.age_window: int | None = None

    # --- construction -------------------------------------------------------------------------------------

    @classmethod
    def create(cls, cfg: PopuLoRAConfig) -> Population:
        """Founders: ``t0..t{T-1}`` in slots ``0..T-1``, then ``s0..s{S-1}``; or ``a0`` alone (single agent)."""
        pop = cls(Ratings.from_config(cfg.matchmaking), mode=cfg.population.mode)
        if cfg.pbt.enabled and cfg.population.mode != "single_agent":
            pop.age_window = cfg.pbt.quiet_steps
        if cfg.population.mode == "single_agent":
            pop.add(Member("a0", "both", slot=0))
            return pop
        nt, ns = cfg.population.num_teachers, cfg.population.num_students
        for i in range(nt):
            pop.add(Member(f"t{i}", "teacher", slot=i))
        for i in range(ns):
            pop.add(Member(f"s{i}", "student", slot=nt + i))
        return pop

    def add(self, member: Member, mu: float | None = None, sigma: float | None = None) -> Member:
        """Add a living member (rated at the prior unless ``mu`` / ``sigma`` are given)."""
        if member.id in self._lineage:
            raise ValueError(f"member id {member.id!r} was already used")
        if not member.alive:
            raise ValueError(f"cannot add dead member {member.id!r}")
        if any(m.slot == member.slot for m in self.members):
            raise ValueError(f"slot {member.slot} is taken by a living member")
        self._lineage[member.id] = member
        self.ratings.add(member.id, mu=mu, sigma=sigma)
        return member

    # --- queries ------------------------------------------------------------------------------------------

    @property
    def members(self) -> list[Member]:
        return sorted((m for m in self._lineage.values() if m.alive), key=lambda m: m.slot)

    @property
    def lineage(self) -> list[Member]:
        return list(self._lineage.values())

    def ids(self) -> list[str]:
        return [m.id for m in self.members]

    def member(self, member_id: str) -> Member:
        try:
            return self._lineage[member_id]
        except KeyError:
            raise KeyError(f"unknown member {member_id!r}") from None

    def role_members(self, role: str) -> list[Member]:
        """Alive members that play ``role``; the single agent plays both."""
        return [m for m in self.members if m.role == role or m.role == "both"]

    def teachers(self) -> list[Member]:
        return self.role_members("teacher")

    def students(self) -> list[Member]:
        return self.role_members("student")

    def next_id(self, role: str, offset: int = 0) -> str:
        """The id the next child of ``role`` gets (``offset`` looks further ahead, for plans of several)."""
        prefix = ROLE_PREFIX[role]
        used = [m.number for m in self._lineage.values() if m.id[0] == prefix]
        return f"{prefix}{(max(used) + 1 if used else 0) + offset}"

    def age(self, member_id: str) -> int:
        """Steps the member has trained since its birth."""
        return int(self.member(member_id).age)

    def tick(self) -> None:
        """One population step has been completed: every living member is one step older."""
        for m in self.members:
            m.age += 1

    def young(self, window: int | None = None) -> list[Member]:
        """Living members younger than ``window`` steps (default: :attr:`age_window`; none if both are None)."""
        window = self.age_window if window is None else window
        if window is None:
            return []
        return [m for m in self.members if m.age < window]

    def fitness(
        self, kind: str = "trueskill_conservative", recent_rewards: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """Fitness of every alive member: ``trueskill_conservative`` (mu - 3 sigma), ``mu`` or ``recent_reward``."""
        ids = self.ids()
        if kind == "trueskill_conservative":
            return {i: self.ratings.conservative(i) for i in ids}
        if kind == "mu":
            return {i: self.ratings.mu(i) for i in ids}
        if kind == "recent_reward":
            if recent_rewards is None:
                raise ValueError("fitness 'recent_reward' needs recent_rewards={member_id: mean reward}")
            missing = [i for i in ids if i not in recent_rewards]
            if missing:
                raise ValueError(f"fitness 'recent_reward': no recent reward for members {missing}")
            return {i: float(recent_rewards[i]) for i in ids}
        raise ValueError(f"unknown fitness {kind!r}; expected trueskill_conservative | mu | recent_reward")

    # --- evolution ----------------------------------------------------------------------------------------

    def replace(
        self,
        victim_id: str,
        child_id: str,
        parents: Sequence[str],
        operator: str,
        step: int,
        mu: float | None = None,
        sigma: float | None = None,
    ) -> Member:
        """The victim dies at ``step``; the child is born into its slot with the given (or prior) rating."""
        victim = self.member(victim_id)
        if not victim.alive:
            raise ValueError(f"victim {victim_id!r} is already dead (step {victim.death_step})")
        for p in parents:
            if not self.member(p).alive:
                raise ValueError(f"parent {p!r} of {child_id!r} is dead")
        gen = 1 + max(self.member(p).generation for p in parents) if parents else 0
        final = self.ratings.remove(victim_id)
        victim.death_step, victim.final_mu, victim.final_sigma = int(step), float(final.mu), float(final.sigma)
        child = Member(
            child_id,
            victim.role,
            slot=victim.slot,
            parents=tuple(parents),
            operator=operator,
            birth_step=int(step),
            generation=gen,
        )
        return self.add(child, mu=mu, sigma=sigma)

    # --- persistence --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "step": self.step,
            "ratings": self.ratings.state_dict(),
            "lineage": [m.to_dict() for m in self._lineage.values()],
            "states": {},
            "lora_config": self.lora_config,
            "age_window": self.age_window,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Population:
        ratings_state = state["ratings"]
        pop = cls(Ratings(**ratings_state["env"]), mode=state["mode"])
        pop.step = int(state["step"])
        for d in state["lineage"]:
            if "age" not in d:  # a save from before ages were kept: steps since birth (death) is the best guess
                end = d.get("death_step") if d.get("death_step") is not None else pop.step
                d = {**d, "age": max(0, int(end) - int(d.get("birth_step", 0)))}
            m = Member.from_dict(d)
            pop._lineage[m.id] = m
        alive = set(pop.ids())
        rated = set(ratings_state["ratings"])
        if alive != rated:
            raise ValueError(f"population state is inconsistent: alive {sorted(alive)} vs rated {sorted(rated)}")
        pop.ratings.load_ratings(ratings_state["ratings"].items())
        pop.states = dict(state.get("states") or {})
        pop.lora_config = state.get("lora_config")
        pop.age_window = state.get("age_window")
        return pop

    def save(
        self,
        directory: str | Path,
        adapters: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
        lora_config: Mapping[str, Any] | None = None,
        *,
        states: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write ``population.json`` (+ ``adapters/<id>/`` PEFT folders) atomically; see :mod:`.state`."""
        return save_population(self, directory, adapters=adapters, lora_config=lora_config, states=states)

    @classmethod
    def load(cls, directory: str | Path) -> tuple[Population, dict[str, dict[str, torch.Tensor]] | None]:
        """Inverse of :meth:`save`: ``(population, adapters or None)``."""
        state, adapters = read_population_state(directory)
        population = cls.from_state_dict(state)
        if adapters is not None and sorted(adapters) != sorted(population.ids()):
            raise ValueError(
                f"{Path(directory) / POPULATION_FILE}: adapters {sorted(adapters)} do not match the "
                f"alive members {population.ids()}"
            )
        return population, adapters

    def __repr__(self) -> str:
        return f"Population(mode={self.mode!r}, step={self.step}, members={self.ids()})"
