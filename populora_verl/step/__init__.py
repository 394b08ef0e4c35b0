"""The population step: one orchestration driven by the CPU driver and by the verl trainer (see
:mod:`populora_verl.step.orchestration`), and the engine contract both implement (:mod:`populora_verl.step.engine`)."""

from populora_verl.step.compute import (
    ComputePlan,
    check_compute_plan,
    compute_plan,
    planned_trajectories,
    realised_compute,
)
from populora_verl.step.engine import EvolutionResult, Phase, PopulationEngine, apply_evolution, evolve, seed_buffers
from populora_verl.step.orchestration import PopulationStep
from populora_verl.step.records import GenRequest, GenResponse, Sample, StepResult, TeacherRecord

__all__ = [
    "GenRequest",
    "GenResponse",
    "PopulationStep",
    "Sample",
    "StepResult",
    "TeacherRecord",
    "TaskEnv",
    "realised_compute",
    "planned_trajectories",
    "ComputePlan",
    "compute_plan",
    "check_compute_plan",
    "PopulationEngine",
    "Phase",
    "EvolutionResult",
    "seed_buffers",
    "apply_evolution",
    "evolve",
]


def __getattr__(name: str):
    if name == "TaskEnv":  # lazy: binds the tasks / reward / executor parts
        from populora_verl.step.task_env import TaskEnv

        return TaskEnv
    raise AttributeError(name)
