"""verl reward manager ``populora_code``: per-trajectory scoring of proposals and answers.

verl 0.9.1's reward loop hands :meth:`PopuLoRACodeRewardManager.run_single` one trajectory at a time, in a
CPU ``RewardLoopWorker``. The manager never sees the group or the population, so it does what one trajectory
allows and leaves learnability to the driver (``populora_verl.reward.levels``):

- **propose** trajectories: parse and validate the proposal in the executor. ``reward_score`` is
  ``rewards.format_error`` / ``rewards.invalid_program`` for a failed proposal and a provisional 0.0 for a
  valid one (the driver overwrites it with the learnability reward after the student phase).
  ``reward_extra_info["populora_task"]`` carries the validated task as JSON, for a driver of the reward loop that
  builds student prompts from verl's outputs (the ``populora`` trainer validates in its own population step and
  does not read it).
- **solve** trajectories: score the answer against the task (``rewards.correct`` / ``wrong_answer`` /
  ``format_error``).

Per-sample input: ``non_tensor_batch["populora"]``, a dict (or its JSON string) with the fields in
:data:`FIELD_DOC`. Every trajectory returns the same ``reward_extra_info`` keys (verl stacks them into arrays
keyed by the first sample's keys).

The executor is created once per process, on first use, from the ``populora.executor`` section of the trainer
config.

**Deferred rows.** The ``populora`` verl trainer scores every trajectory itself in the population step (the only
place that sees the matched students); it marks its prompts ``scored_by="population_step"``, and for those the
manager returns a neutral 0.0 without decoding or executing anything, so no program runs twice and reward workers
start no sandbox processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Mapping

from verl import DataProto
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from populora_verl import verl_compat
from populora_verl.config import TASK_TYPES, PopuLoRAConfig, load_config
from populora_verl.reward.levels import teacher_reward
from populora_verl.tasks.task import Task
from populora_verl.tasks.verify import score_answer, validate_proposal

logger = logging.getLogger(__name__)

__all__ = ["NAME", "FIELD", "FIELD_DOC", "EXTRA_KEYS", "PopuLoRACodeRewardManager", "register", "populora_info"]

NAME = "populora_code"
FIELD = "populora"
DEFERRED_TO = "population_step"  # ``populora.scored_by`` value of rows the trainer scores itself
FIELD_DOC = {
    "role": "'propose' (teacher / proposer trajectory) or 'solve' (student / solver trajectory); "
    "'teacher' and 'student' are accepted as aliases",
    "task_type": "'code_i' | 'code_o' | 'code_f'",
    "adapter": "member id of the adapter that generated the trajectory (t0, s3, a0, ...)",
    "step": "training step (int), stamped on validated tasks",
    "task": "Task JSON: for 'solve', the task to solve; for a code_f 'propose', the buffered program shown",
    "think_prefilled": "optional bool (default true): the prompt ended with '<think>'",
    "scored_by": "optional: 'population_step' when the populora trainer scores the trajectory itself (deferred)",
}
EXTRA_KEYS = (
    "populora_role",
    "populora_task_type",
    "populora_adapter",
    "populora_status",
    "populora_correct",
    "populora_valid",
    "populora_task",
    "populora_task_id",
    "populora_reason",
)

# "seed": the seeding phase's base-policy proposals (validated like a teacher's, never trained on).
_ROLE_ALIASES = {"propose": "propose", "teacher": "propose", "seed": "propose", "solve": "solve", "student": "solve"}


def populora_info(raw: Any) -> dict[str, Any]:
    """Validate and normalise one sample's ``populora`` field (dict or JSON string). ``ValueError`` if bad."""
    if isinstance(raw, (str, bytes)):
        raw = json.loads(raw)
    if not isinstance(raw, Mapping):
        raise ValueError(f"non_tensor_batch[{FIELD!r}] must be a dict or JSON object, got {type(raw).__name__}")
    info = dict(raw)
    role = _ROLE_ALIASES.get(str(info.get("role", "")))
    if role is None:
        raise ValueError(f"{FIELD}.role must be one of {sorted(_ROLE_ALIASES)}, got {info.get('role')!r}")
    info["role"] = role
    if info.get("task_type") not in TASK_TYPES:
        raise ValueError(f"{FIELD}.task_type must be one of {list(TASK_TYPES)}, got {info.get('task_type')!r}")
    needs_task = role == "solve" or info["task_type"] == "code_f"
    if needs_task:
        t = info.get("task")
        if not t:
            raise ValueError(f"{FIELD}.task is required for role={role} task_type={info['task_type']}")
        info["task"] = Task.from_json(t) if isinstance(t, str) else Task.from_dict(t)
    info["adapter"] = str(info.get("adapter", ""))
    info["step"] = int(info.get("step", -1))
    info["think_prefilled"] = bool(info.get("think_prefilled", True))
    info["deferred"] = info.get("scored_by") == DEFERRED_TO
    return info


def _populora_section(config: Any) -> Any:
    if config is None:
        return None
    getter = getattr(config, "get", None)
    return getter(FIELD, None) if callable(getter) else getattr(config, FIELD, None)


class PopuLoRACodeRewardManager(RewardManagerBase):
    """Scores AZR proposals and answers through the sandboxed executor (one per worker process)."""

    cfg: PopuLoRAConfig | None = None
    executor: Any = None

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)

    @classmethod
    def _setup(cls, config) -> None:
        cls.cfg = load_config(_populora_section(config))
        cls.executor = None  # started on first use (_get_executor): deferred-only workers never need one

    # A verl with RewardManagerBase.setup_class runs it once per class; verl 0.9.1 leaves the once-only guard on its
    # private flag to each manager's init_class.
    if verl_compat.has_reward_class_setup():

        @classmethod
        def setup_class(cls, config, tokenizer) -> None:
            cls._setup(config)

    else:

        @classmethod
        def init_class(cls, config, tokenizer) -> None:
            verl_compat.private_path("_class_initialized")
            if cls._class_initialized:
                return
            cls._setup(config)
            cls._class_initialized = True

    @classmethod
    def _get_executor(cls) -> Any:
        if cls.executor is None:
            cls.executor = cls._make_executor(cls.cfg)
        return cls.executor

    @classmethod
    def _make_executor(cls, cfg: PopuLoRAConfig) -> Any:
        import atexit

        from populora_verl.executor import Executor

        ex = Executor.from_config(cfg.executor)
        close = getattr(ex, "close", None)
        if callable(close):
            atexit.register(close)
        return ex

    @classmethod
    def reset_class(cls) -> None:
        """Forget the per-process state (tests; a new config). Closes the executor if it can be closed."""
        close = getattr(cls.executor, "close", None)
        if callable(close):
            close()
        cls.cfg, cls.executor = None, None
        if verl_compat.has_reward_class_setup():
            super().reset_class()
        else:
            verl_compat.private_path("_class_initialized")
            cls._class_initialized = False

    # --- scoring -------------------------------------------------------------------------------------
    def _decode(self, item) -> str:
        response_ids = item.batch["responses"]
        n = response_ids.shape[-1]
        valid = int(item.batch["attention_mask"][-n:].sum())
        return self.tokenizer.decode(response_ids[:valid], skip_special_tokens=True)

    def score_text(self, info: Mapping[str, Any], text: str) -> dict[str, Any]:
        """Score one decoded response given its normalised ``populora`` info (blocking; runs the executor)."""
        cfg = self.cfg
        extra = {
            "populora_role": info["role"],
            "populora_task_type": info["task_type"],
            "populora_adapter": info["adapter"],
            "populora_status": "",
            "populora_correct": 0.0,
            "populora_valid": 0.0,
            "populora_task": "",
            "populora_task_id": "",
            "populora_reason": "",
        }
        if info.get("deferred"):
            extra.update(populora_status="deferred", populora_reason=f"scored by the {DEFERRED_TO}")
            return {"reward_score": 0.0, "reward_extra_info": extra}
        if info["role"] == "propose":
            res = validate_proposal(
                text,
                info["task_type"],
                self._get_executor(),
                cfg,
                program=info.get("task"),
                teacher=info["adapter"],
                step=info["step"],
                think_prefilled=info["think_prefilled"],
            )
            extra.update(populora_status=res.status, populora_reason=res.reason, populora_valid=float(res.has_task))
            if res.has_task:  # AZR: a valid program is a task even under a failed envelope
                extra.update(populora_task=res.task.to_json(), populora_task_id=res.task.id)
            # a valid proposal's 0.0 is provisional: the step assigns learnability once the students have answered
            score = 0.0 if res.valid else teacher_reward(res.status, None, cfg.rewards)
        else:
            task: Task = info["task"]
            s = score_answer(task, text, self._get_executor(), cfg, think_prefilled=info["think_prefilled"])
            extra.update(
                populora_status=s.status,
                populora_reason=s.reason,
                populora_correct=float(s.correct),
                populora_valid=1.0,
                populora_task_id=task.id,
            )
            score = float(s.reward)
        return {"reward_score": score, "reward_extra_info": extra}

    async def run_single(self, data: DataProto) -> dict:
        item = data[-1:][0]  # multi-sequence outputs: the last sequence carries the answer (as verl's naive)
        info = populora_info(item.non_tensor_batch[FIELD])
        if info["deferred"]:
            return self.score_text(info, "")
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(None, self._decode, item)
        return await loop.run_in_executor(None, self.score_text, info, text)


def register() -> type[PopuLoRACodeRewardManager]:
    """Register :class:`PopuLoRACodeRewardManager` with verl as ``populora_code``; safe to call repeatedly."""
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
    from verl.experimental.reward_loop.reward_manager.registry import register as verl_register

    current = REWARD_MANAGER.get(NAME)
    if current is PopuLoRACodeRewardManager:
        return current
    if current is not None and (current.__module__, current.__qualname__) == (
        PopuLoRACodeRewardManager.__module__,
        PopuLoRACodeRewardManager.__qualname__,
    ):
        del REWARD_MANAGER[NAME]  # the same class from a reloaded module: replace it
    verl_register(NAME)(PopuLoRACodeRewardManager)
    return PopuLoRACodeRewardManager
