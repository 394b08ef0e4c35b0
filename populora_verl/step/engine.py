"""What the population step needs from an engine, and the engine-facing parts of a run written once.

:class:`~populora_verl.step.orchestration.PopulationStep` never generates or touches weights itself; the CPU driver
(HF + PEFT) and the verl trainer (vLLM + the workers' adapter bank) do. Around the step's phases both drivers ran
the same loops: the seeding rounds, and writing each evolution child into its victim's slot with the fitter
parent's optimizer state or a fresh one. Those loops live here, so a change to them (what evolution.jsonl holds,
which optimizer a child keeps) reaches both engines at once.

The contract is split by where an evolution child is made, so that no engine carries a method nothing calls:
every engine is a :class:`PopulationEngine` (generation, parent reads); the CPU driver makes children itself and is
also a :class:`ChildWriter`; the verl trainer leaves them to the workers that hold the adapters and is a
:class:`PlanEngine` instead. :func:`evolve` takes either.

An engine speaks in member *slots* (``Member.slot``, an ``int``): slots are what survives an evolution event, and
both engines address their adapters by slot (PEFT adapter ``slot<k>``, bank slot ``k``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, Sequence, runtime_checkable

from populora_verl.evolution.pbt import append_event, describe
from populora_verl.step.records import SEED, GenRequest, GenResponse

if TYPE_CHECKING:
    import torch

    from populora_verl.evolution.pbt import EvolutionPlan
    from populora_verl.step.orchestration import PopulationStep

__all__ = [
    "Phase",
    "PopulationEngine",
    "ChildWriter",
    "PlanEngine",
    "AdapterView",
    "EvolutionResult",
    "SEED_FILE",
    "seed_file",
    "seed_buffers",
    "apply_evolution",
    "plan_entries",
    "evolve",
]

#: The seeding phase's programs in the run directory, in ``buffer.seed_file`` format (reuse them in a later run).
SEED_FILE = "seed_tasks.jsonl"


@dataclass(frozen=True)
class Phase:
    """Which generation a batch of requests belongs to.

    ``name`` is the requests' role (``SEED``, ``TEACHER`` or ``STUDENT`` of :mod:`.records`): verl names its
    rollout metrics and serves the seeding phase's base policy by it. ``step`` (0 while seeding) and ``round``
    (the seeding round) let an engine derive its sampling seed, so that a resumed run replays generation exactly.
    """

    name: str
    step: int
    round: int = 0


@runtime_checkable
class PopulationEngine(Protocol):
    """What every engine gives the population step: generation for a phase, and a slot's adapter to read.

    Training is not part of it: the CPU driver updates one adapter at a time, verl updates every adapter from its
    TransferQueue rows, and the step only hands over the samples (``StepResult.updates``). Neither is writing an
    evolution child, because the engines make children in different places (:class:`ChildWriter`,
    :class:`PlanEngine`).
    """

    def generate(self, requests: Sequence[GenRequest], phase: Phase) -> list[GenResponse]:
        """One :class:`GenResponse` per request (in order), ``request.n`` completions each."""
        ...

    def get_adapter(self, slot: int) -> Mapping[str, torch.Tensor]:
        """Slot ``slot``'s LoRA state dict (full tensors on the CPU): what PBT's operators read from a parent."""
        ...


@runtime_checkable
class ChildWriter(Protocol):
    """An engine whose evolution children are made on the driver (PBT's operators over :meth:`get_adapter` reads)
    and then written into their slots: the CPU driver, where every adapter is already in the driver's process."""

    def write_child(self, slot: int, state: Mapping[str, torch.Tensor], optimizer_from: int | None) -> None:
        """Overwrite slot ``slot`` with an evolution child. ``optimizer_from=None``: the slot starts with a fresh
        optimizer; otherwise it takes a copy of slot ``optimizer_from``'s optimizer state (a child keeping its
        parent's moments). Never the victim's own state: those moments belong to weights that are gone."""
        ...


@runtime_checkable
class PlanEngine(Protocol):
    """An engine that makes evolution children where the adapters live (the verl workers), so no adapter crosses a
    process: it gets the plan in slots and returns the seconds of each phase of the event, not the children. Such an
    engine needs no :class:`ChildWriter` side: :func:`evolve` never hands it a child."""

    def apply_plan(self, entries: Sequence[Mapping[str, Any]]) -> Mapping[str, float]:
        """Make and write every child of ``entries`` (``child_slot``, ``operator``, ``parent_slots`` fittest first,
        ``seed``, ``params``, ``reset_optimizer``: a fresh optimizer, or a copy of ``parent_slots[0]``'s), each
        from the pre-event parents. Returns ``{phase: seconds}`` (gather, operator, scatter, optimizer)."""
        ...


class AdapterView(Mapping):
    """``{member id: state dict}`` over an engine that reads a slot only when asked: PBT reads parents only, and a
    slot read is a gather across the verl workers (a copy on the CPU driver)."""

    def __init__(self, engine: PopulationEngine, slot_of: Mapping[str, int]) -> None:
        self._engine, self._slot_of, self._cache = engine, dict(slot_of), {}

    def __getitem__(self, member_id: str) -> Mapping[str, torch.Tensor]:
        if member_id not in self._cache:
            self._cache[member_id] = self._engine.get_adapter(self._slot_of[member_id])
        return self._cache[member_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._slot_of)

    def __len__(self) -> int:
        return len(self._slot_of)


def seed_buffers(step: PopulationStep, engine: PopulationEngine, run_dir: str | os.PathLike | None = None) -> int:
    """The seeding phase (``buffer.seed_programs``): rounds of base-policy proposals until the step reports the
    buffers seeded (or ``buffer.seed_rounds`` spent); returns the rounds run, 0 when there was nothing to seed.

    After at least one round the seed set goes to ``<run_dir>/seed_tasks.jsonl`` (``buffer.seed_file`` format), so
    a later run can start from it without spending the rounds again.
    """
    rounds = 0
    while True:
        requests = step.seed_begin()
        if not requests:
            break
        step.seed_on_proposals(engine.generate(requests, Phase(SEED, 0, rounds)))
        rounds += 1
    if rounds and run_dir is not None:
        from populora_verl.tasks import save_seed_file

        os.makedirs(run_dir, exist_ok=True)
        save_seed_file(step.seed_set, seed_file(run_dir))
    return rounds


def seed_file(run_dir: str | os.PathLike) -> str:
    """Where :func:`seed_buffers` writes the seed set of the run in ``run_dir``."""
    return os.path.join(os.fspath(run_dir), SEED_FILE)


@dataclass
class EvolutionResult:
    """What an evolution event did: its plan (``None`` when none was due), the metrics row's evolution keys, one
    log line per replacement (the verl trainer prints them; the CPU driver's step line names the replacements), and
    the seconds of each phase where a :class:`PlanEngine` made the children (empty otherwise)."""

    plan: EvolutionPlan | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    timing: dict[str, float] = field(default_factory=dict)


def apply_evolution(
    plan: EvolutionPlan,
    children: Mapping[str, Mapping[str, Any]],
    engine: ChildWriter,
    slot_of: Mapping[str, int],
    run_dir: str | os.PathLike,
) -> EvolutionResult:
    """Write each child of ``plan`` into its victim's slot, in plan order, and record the event.

    A child takes a copy of its first (fittest) parent's optimizer state unless ``Replacement.reset_optimizer``.
    ``slot_of`` maps member ids to slots as they were when the plan was made (parents are survivors, so theirs do
    not change). An event with replacements is appended to ``<run_dir>/evolution.jsonl``.

    Every optimizer must be handed on as it was before the event; an engine may read it when the child is written
    (verl copies it on the workers then), so a plan whose optimizer source is also overwritten by that plan is
    refused before anything is written.
    """
    for r in plan.replacements:
        if r.child_id not in children:
            raise KeyError(f"evolution at step {plan.step}: no state for child {r.child_id!r}")
    writes = [
        (int(r.victim_slot), children[r.child_id], source)
        for r, source in zip(plan.replacements, _sources(plan, slot_of))
    ]
    for slot, state, source in writes:
        engine.write_child(slot, state, source)
    return _recorded(plan, run_dir)


def _sources(plan: EvolutionPlan, slot_of: Mapping[str, int]) -> list[int | None]:
    """Each child's optimizer source slot (``None``: a fresh one); refuses a plan that writes a slot twice or hands
    on an optimizer it also overwrites, before anything is written."""
    victims = {int(r.victim_slot) for r in plan.replacements}
    if len(victims) != len(plan.replacements):
        raise ValueError(
            f"evolution at step {plan.step} writes a slot twice: {[int(r.victim_slot) for r in plan.replacements]}"
        )
    sources = []
    for r in plan.replacements:
        source = None if r.reset_optimizer else int(slot_of[r.parent_ids[0]])
        if source is not None and source in victims:
            raise ValueError(
                f"evolution at step {plan.step}: {r.child_id}'s optimizer would come from slot {source}, "
                "which this event overwrites; parents must be survivors"
            )
        sources.append(source)
    return sources


def _recorded(
    plan: EvolutionPlan, run_dir: str | os.PathLike, timing: Mapping[str, float] | None = None
) -> EvolutionResult:
    if plan.replacements:
        append_event(run_dir, plan)
    ties = sum(bool(r.tie_break) for r in plan.replacements)
    return EvolutionResult(
        plan,
        {"populora/evolution/events": float(len(plan.replacements)), "populora/evolution/tie_breaks": float(ties)},
        [f"[populora] step {plan.step} evolution: {describe(r)}" for r in plan.replacements],
        dict(timing or {}),
    )


def plan_entries(plan: EvolutionPlan, slot_of: Mapping[str, int]) -> list[dict[str, Any]]:
    """The plan in slots, as a :class:`PlanEngine` (and the workers' ``apply_evolution_plan``) takes it."""
    _sources(plan, slot_of)
    return [
        {
            "child_slot": int(r.victim_slot),
            "operator": r.operator,
            "parent_slots": [int(slot_of[p]) for p in r.parent_ids],
            "seed": int(r.seed),
            "params": dict(r.params),
            "reset_optimizer": bool(r.reset_optimizer),
        }
        for r in plan.replacements
    ]


def evolve(
    step: PopulationStep, global_step: int, engine: PopulationEngine, run_dir: str | os.PathLike
) -> EvolutionResult:
    """PBT after ``global_step`` when it is due (:meth:`PopulationStep.maybe_evolve`), then
    :func:`apply_evolution`; an empty :class:`EvolutionResult` when it is not due. Only the parents' adapters are
    read from the engine.

    ``engine`` must also be a :class:`PlanEngine` or a :class:`ChildWriter`. A :class:`PlanEngine` makes the
    children itself from the plan in slots (:func:`plan_entries`); the population takes them once they are written,
    and the result carries the engine's seconds per phase. It is checked first, so an engine that is both keeps the
    adapters where they live. One that is neither is refused before PBT runs, so a wrong engine fails at its first
    step rather than at the first event that is due."""
    _check_evolves(engine)
    slot_of = {m.id: int(m.slot) for m in step.population.members}
    if isinstance(engine, PlanEngine):
        plan = step.plan_evolution(global_step)
        if plan is None:
            return EvolutionResult()
        entries = plan_entries(plan, slot_of)
        timing = engine.apply_plan(entries) if entries else {}
        step.commit_evolution(plan)
        return _recorded(plan, run_dir, timing)
    plan, children = step.maybe_evolve(global_step, AdapterView(engine, slot_of))
    if plan is None:
        return EvolutionResult()
    return apply_evolution(plan, children, engine, slot_of, run_dir)


def _check_evolves(engine: object) -> None:
    if isinstance(engine, PlanEngine):
        return
    # The driver's way reads the parents (get_adapter) as well as writing the children.
    missing = [name for name in ("get_adapter", "write_child") if not callable(getattr(engine, name, None))]
    if missing:
        raise TypeError(
            f"evolve: {type(engine).__name__} cannot make evolution children: it has no apply_plan (a PlanEngine, "
            f"children made where the adapters live) and no {' or '.join(missing)} (children made on the driver "
            "need get_adapter to read the parents and write_child, a ChildWriter, to write them)"
        )
