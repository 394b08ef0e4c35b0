"""TrueSkill ratings of teachers and students, and the rules that turn a match into game outcomes.

A *match* is one teacher's valid problems answered by one matched student. The student "beats" the teacher when
it solves more than expected, so ratings track who is ahead in the zero-sum game of proposing vs solving.

Win probability (the ``trueskill`` package has none, so it is computed here):

    p = P(student beats teacher) = Phi((mu_s - mu_t) / sqrt(sigma_s^2 + sigma_t^2 + 2 beta^2))
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import trueskill

from populora_verl.config import MatchmakingConfig

__all__ = [
    "STUDENT_WINS",
    "TEACHER_WINS",
    "DRAW",
    "OUTCOME_RULES",
    "Ratings",
    "match_outcomes",
]

STUDENT_WINS = "student"
TEACHER_WINS = "teacher"
DRAW = "draw"
OUTCOME_RULES = ("learnable", "vs_expected", "vs_half", "per_problem")


def _compare(observed: float, expected: float) -> str:
    if observed > expected:
        return STUDENT_WINS
    if observed < expected:
        return TEACHER_WINS
    return DRAW


def match_outcomes(
    solve_rates: Sequence[float], expected: float, rule: str = "vs_expected", invalid: int = 0
) -> list[str]:
    """Game outcomes of one match, from the student's solve rate on each of the teacher's valid problems.

    ``invalid``: the teacher's proposals in this match that were not valid tasks; only ``learnable`` reads it.

    - ``learnable``: ``vs_expected`` over all of the teacher's proposals, where a proposal that teaches nothing
      (an invalid one, or a problem no answer solved, s̄ = 0) counts as fully solved (s̄ = 1): a point for the
      student, never for the teacher. A teacher wins by posing valid problems its student solves sometimes,
      less often than the ratings predict.
    - ``vs_expected``: one game; the mean solve rate against ``expected`` (the win probability p). A teacher
      also wins with problems nobody can solve.
    - ``vs_half``: one game; the mean solve rate against 0.5.
    - ``per_problem``: one game per problem; a problem is won by the student when its solve rate is above 0.5
      (with one sample per problem: solved), by the teacher below 0.5, drawn at exactly 0.5.

    A match without any valid problem is one student win under every rule: a teacher that cannot pose a valid
    problem has lost the round.
    """
    if rule not in OUTCOME_RULES:
        raise ValueError(f"unknown match outcome rule {rule!r}; expected one of {list(OUTCOME_RULES)}")
    rates = [float(r) for r in solve_rates]
    for r in rates:
        if not 0.0 <= r <= 1.0:  # also rejects NaN
            raise ValueError(f"solve rates must be in [0, 1], got {r!r}")
    if int(invalid) < 0:
        raise ValueError(f"invalid must be >= 0, got {invalid!r}")
    if not rates:
        return [STUDENT_WINS]
    if rule == "per_problem":
        return [_compare(r, 0.5) for r in rates]
    if rule == "learnable":
        rates = [1.0 if r == 0.0 else r for r in rates] + [1.0] * int(invalid)
    mean = math.fsum(rates) / len(rates)
    return [_compare(mean, expected if rule == "vs_expected" else 0.5)]


class Ratings:
    """Per-member TrueSkill ratings over one shared environment (prior, beta, tau, draw probability)."""

    def __init__(
        self,
        mu: float = 25.0,
        sigma: float = 25.0 / 3,
        beta: float = 25.0 / 6,
        tau: float = 25.0 / 300,
        draw_probability: float = 0.1,
    ) -> None:
        # backend=None: the package's own pure-Python cdf/pdf/ppf, identical on every machine.
        self.env = trueskill.TrueSkill(
            mu=mu, sigma=sigma, beta=beta, tau=tau, draw_probability=draw_probability, backend=None
        )
        self._ratings: dict[str, trueskill.Rating] = {}

    @classmethod
    def from_config(cls, cfg: MatchmakingConfig) -> Ratings:
        return cls(mu=cfg.mu, sigma=cfg.sigma, beta=cfg.beta, tau=cfg.tau, draw_probability=cfg.draw_probability)

    # --- the table ----------------------------------------------------------------------------------------

    @property
    def env_params(self) -> dict[str, float]:
        e = self.env
        return {"mu": e.mu, "sigma": e.sigma, "beta": e.beta, "tau": e.tau, "draw_probability": e.draw_probability}

    def prior(self) -> trueskill.Rating:
        return self.env.create_rating()

    def add(self, member_id: str, mu: float | None = None, sigma: float | None = None) -> None:
        """Add a member at the prior (or at the given mu / sigma)."""
        if member_id in self._ratings:
            raise KeyError(f"member {member_id!r} is already rated")
        self._ratings[member_id] = self.env.create_rating(mu=mu, sigma=sigma)

    def remove(self, member_id: str) -> trueskill.Rating:
        return self._ratings.pop(member_id)

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._ratings

    def __len__(self) -> int:
        return len(self._ratings)

    def __iter__(self):
        return iter(self._ratings)

    def ids(self) -> list[str]:
        return list(self._ratings)

    def __getitem__(self, member_id: str) -> trueskill.Rating:
        try:
            return self._ratings[member_id]
        except KeyError:
            raise KeyError(f"no rating for member {member_id!r}") from None

    def mu(self, member_id: str) -> float:
        return float(self[member_id].mu)

    def sigma(self, member_id: str) -> float:
        return float(self[member_id].sigma)

    def conservative(self, member_id: str) -> float:
        """mu - 3 sigma: a lower bound on skill that a lucky newcomer cannot top."""
        r = self[member_id]
        return float(r.mu - 3.0 * r.sigma)

    # --- matches ------------------------------------------------------------------------------------------

    def win_probability(self, student_id: str, teacher_id: str) -> float:
        """P(student beats teacher) = Phi((mu_s - mu_t) / sqrt(sigma_s^2 + sigma_t^2 + 2 beta^2))."""
        s, t = self[student_id], self[teacher_id]
        denom = math.sqrt(s.sigma**2 + t.sigma**2 + 2.0 * self.env.beta**2)
        return float(self.env.cdf((s.mu - t.mu) / denom))

    def rate_game(self, teacher_id: str, student_id: str, outcome: str) -> None:
        """Update both ratings after one game (``student`` | ``teacher`` | ``draw``)."""
        if outcome == STUDENT_WINS:
            ranks = [1, 0]
        elif outcome == TEACHER_WINS:
            ranks = [0, 1]
        elif outcome == DRAW:
            ranks = [0, 0]
        else:
            raise ValueError(f"unknown game outcome {outcome!r}")
        (t,), (s,) = self.env.rate([(self[teacher_id],), (self[student_id],)], ranks=ranks)
        self._ratings[teacher_id], self._ratings[student_id] = t, s

    def rate_match(
        self,
        teacher_id: str,
        student_id: str,
        solve_rates: Sequence[float],
        rule: str = "vs_expected",
        invalid: int = 0,
    ) -> list[str]:
        """Rate one match; returns the game outcomes applied (in order).

        A member matched against itself (the single agent ``a0`` teaching itself) is not rated: a self-play game
        carries no information about relative skill, and TrueSkill cannot rate one player on both sides.
        """
        if teacher_id == student_id:
            return []
        outcomes = match_outcomes(solve_rates, self.win_probability(student_id, teacher_id), rule, invalid)
        for o in outcomes:
            self.rate_game(teacher_id, student_id, o)
        return outcomes

    # --- persistence --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # JSON floats round-trip exactly (repr is shortest-round-trip), so a save/load keeps every bit.
        return {"env": self.env_params, "ratings": {k: [float(r.mu), float(r.sigma)] for k, r in self._ratings.items()}}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Ratings:
        out = cls(**state["env"])
        out.load_ratings(state["ratings"].items())
        return out

    def load_ratings(self, items: Iterable[tuple[str, Sequence[float]]]) -> None:
        """Replace the whole table with ``(id, (mu, sigma))`` pairs."""
        self._ratings = {k: self.env.create_rating(mu=float(v[0]), sigma=float(v[1])) for k, v in items}

    def metrics(self, prefix: str = "populora/rating") -> dict[str, float]:
        """Flat metrics-log keys (``populora/rating/<id>/mu|sigma|conservative``)."""
        out: dict[str, float] = {}
        for k in self._ratings:
            out[f"{prefix}/{k}/mu"] = self.mu(k)
            out[f"{prefix}/{k}/sigma"] = self.sigma(k)
            out[f"{prefix}/{k}/conservative"] = self.conservative(k)
        return out
