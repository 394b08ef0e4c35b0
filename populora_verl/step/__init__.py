"""The population step: one orchestration driven by the CPU driver and by the verl trainer (see
:mod:`populora_verl.step.orchestration`)."""

from populora_verl.step.orchestration import (
    GenRequest,
    GenResponse,
    PopulationStep,
    Sample,
    StepResult,
    compute_metrics,
    planned_trajectories,
)

__all__ = ["GenRequest", "GenResponse", "PopulationStep", "Sample", "StepResult", "TaskEnv", "compute_metrics",
           "planned_trajectories"]


def __getattr__(name: str):
    if name == "TaskEnv":  # lazy: binds the tasks / reward / executor parts
        from populora_verl.step.task_env import TaskEnv

        return TaskEnv
    raise AttributeError(name)
