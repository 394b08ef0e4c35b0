"""PFSP matchmaking over TrueSkill: each step pairs every teacher with its student(s).

Prioritised fictitious self-play weighs each candidate student by how balanced the match is. With p the
probability that the student beats the teacher:

- ``p_one_minus_p``: w = p (1 - p), largest at p = 1/2 (the default: train on near-balanced pairs);
- ``hard``: w = 1 - p, students likely to lose face this teacher more often;
- ``uniform``: w = 1.

Every step feeds every student alike: the step's ``teachers x students_per_problem`` matches are shared so that each
student meets ``⌊matches / S⌋`` or ``⌈matches / S⌉`` teachers, and PFSP chooses who meets whom within those quotas.
When the matches do not divide, the students that get the one extra match are drawn from a pool that refills once
every student has had one, so over a few steps every student gets as many. The pool persists across steps (it is
part of the saved state); a newborn student is in the pool at once. A student's trained batch is a fixed number of
tasks per matched teacher, so equal matches are equal compute (``populora_verl.step.compute``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from populora_verl.config import MatchmakingConfig

if TYPE_CHECKING:  # pragma: no cover
    from populora_verl.population.members import Population

__all__ = ["pfsp_weight", "Matchmaker"]


def pfsp_weight(p: float, weight: str = "p_one_minus_p") -> float:
    """PFSP weight of a pair whose student wins with probability ``p``."""
    if weight == "p_one_minus_p":
        return p * (1.0 - p)
    if weight == "hard":
        return 1.0 - p
    if weight == "uniform":
        return 1.0
    raise ValueError(f"unknown PFSP weight {weight!r}; expected p_one_minus_p | hard | uniform")


def _draw(rng: np.random.Generator, weights: Sequence[float]) -> int:
    """Index drawn with probability proportional to ``weights`` (uniform if they are all zero)."""
    total = math.fsum(weights)
    if not total > 0:
        weights, total = [1.0] * len(weights), float(len(weights))
    u = float(rng.random()) * total
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if u < acc:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)  # u landed on the float rounding edge


class Matchmaker:
    """Deterministic (under ``seed``) teacher -> student pairing.

    ``method``: ``pfsp_trueskill`` (weights from ratings), ``uniform`` (PFSP pool with equal weights) or
    ``round_robin`` (teacher i meets student (i + step) mod S, no randomness).
    """

    def __init__(self, cfg: MatchmakingConfig | None = None, seed: int = 0) -> None:
        self.cfg = cfg if cfg is not None else MatchmakingConfig()
        self.seed = int(seed)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._drawn: set[str] = set()  # students that had their extra match in the current pool cycle

    def weight_of(self, population: Population, teacher_id: str, student_id: str) -> float:
        if self.cfg.method == "uniform":
            return 1.0
        return pfsp_weight(population.ratings.win_probability(student_id, teacher_id), self.cfg.weight)

    def pairs(self, population: Population, step: int) -> list[tuple[str, str]]:
        """``[(teacher_id, student_id), ...]``: each teacher (by slot) with ``students_per_problem`` distinct
        students (fewer only when there are fewer students), each student in ``⌊T·k / S⌋`` or ``⌈T·k / S⌉`` pairs.
        The single agent is paired with itself."""
        teachers = [m.id for m in population.teachers()]
        students = [m.id for m in population.students()]
        if not teachers or not students:
            raise ValueError(f"cannot match: {len(teachers)} teachers, {len(students)} students")
        if population.mode == "single_agent":
            return [(t, t) for t in teachers]
        k = min(self.cfg.students_per_problem, len(students))
        if self.cfg.method == "round_robin":
            return [(t, students[(i * k + j + step) % len(students)]) for i, t in enumerate(teachers) for j in range(k)]

        quota = self._quotas(students, len(teachers) * k)
        out: list[tuple[str, str]] = []
        for i, t in enumerate(teachers):
            left = len(teachers) - i  # teachers still to match, this one included
            # A student with as many matches left as there are teachers left must meet every one of them, this one
            # first; otherwise the last teachers would have to draw it twice, or leave its quota unfilled.
            chosen = [s for s in students if quota[s] == left]
            while len(chosen) < k:
                candidates = [s for s in students if quota[s] > 0 and s not in chosen]
                weights = [self.weight_of(population, t, s) for s in candidates]
                chosen.append(candidates[_draw(self._rng, weights)])
            for s in chosen:
                quota[s] -= 1
            out.extend((t, s) for s in chosen)
        return out

    def _quotas(self, students: Sequence[str], matches: int) -> dict[str, int]:
        """Matches per student this step: ``⌊matches / S⌋`` each, one more for ``matches mod S`` students from
        the pool (a student is never given two extras in one step, also when the pool refills mid-step)."""
        base, extra = divmod(matches, len(students))
        self._drawn &= set(students)  # dead students leave the pool cycle
        lucky: list[str] = []
        while len(lucky) < extra:
            pool = [s for s in students if s not in self._drawn and s not in lucky]
            if not pool:  # every student has had its extra this cycle: a new cycle, without this step's picks
                self._drawn = set()
                continue
            s = pool[_draw(self._rng, [1.0] * len(pool))]
            lucky.append(s)
            self._drawn.add(s)
        return {s: base + (s in lucky) for s in students}

    # --- persistence --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "rng": self._rng.bit_generator.state, "drawn": sorted(self._drawn)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._rng = np.random.Generator(np.random.PCG64())
        self._rng.bit_generator.state = dict(state["rng"])
        self._drawn = set(state["drawn"])
