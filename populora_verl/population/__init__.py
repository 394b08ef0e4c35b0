"""The population: members and lineage, TrueSkill ratings, PFSP matchmaking, state save/load.

Plain Python over simple data (no verl, no GPU): the verl trainer and the CPU driver both drive it.
"""

from populora_verl.population.matchmaking import Matchmaker, pfsp_weight
from populora_verl.population.members import ROLE_PREFIX, ROLES, Member, Population
from populora_verl.population.ratings import (
    DRAW,
    OUTCOME_RULES,
    STUDENT_WINS,
    TEACHER_WINS,
    Ratings,
    match_outcomes,
)
from populora_verl.population.state import read_adapter, save_population, write_adapter

#: The function form of :meth:`Population.load`: ``(population, adapters or None)`` from a saved directory.
load_population = Population.load

__all__ = [
    "DRAW",
    "OUTCOME_RULES",
    "ROLES",
    "ROLE_PREFIX",
    "STUDENT_WINS",
    "TEACHER_WINS",
    "Matchmaker",
    "Member",
    "Population",
    "Ratings",
    "load_population",
    "match_outcomes",
    "pfsp_weight",
    "read_adapter",
    "save_population",
    "write_adapter",
]
