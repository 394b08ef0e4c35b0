"""One PopuLoRA population step, independent of the engine that generates and trains.

The same object is driven by the CPU driver (:mod:`populora_verl.local`) and by the verl trainer, between their own
rollout phases::

    requests  = step.begin(n)                      # teacher prompts (with buffer references), one per proposal
    responses = engine.generate(requests)          # GenResponse(request, texts, lengths, extra) per request
    requests  = step.on_proposals(responses)       # validate in the executor -> student prompts (n samples/task)
    responses = engine.generate(requests)
    result    = step.on_answers(responses)         # rewards, teacher learnability, TrueSkill, TRR++ advantages
    for adapter, samples in result.updates.items(): engine.update(adapter, samples)
    plan, children = step.maybe_evolve(n, adapters)  # PBT every E steps; the engine writes children into slots

The single-agent AZR baseline (``populora.population.mode=single_agent``) is the same code: the one member ``a0``
is matched with itself, so it proposes and solves, and it is not rated (TrueSkill needs two players).

Decisions (documented in docs/cpu-driver.md, "Decisions in the population step"):

* A teacher's reward for a proposal is ``invalid_program`` (-1) if it is malformed or fails validation; otherwise
  the learnability of the proposal for its matched student(s): ``1 - s̄`` for ``0 < s̄ < 1`` else ``Z``
  (``rewards.teacher=one_minus``; ``inverse``: ``1 - s̄`` always), with ``s̄`` the mean correctness of the matched
  student's ``student_n`` answers (averaged over students when ``students_per_problem > 1``).
* Students answer their teacher's valid tasks ``student_n`` times: these estimation answers give s̄ and are
  trained on when ``rewards.train_on_estimation_rollouts``. ``buffer.student_mix=fallback``: for each task the
  teacher failed to make valid, each matched student gets one buffer task of that type instead, so every student
  answers ``teacher_n x proposals_per_type`` tasks per type. ``max_new`` (AZR's solver batch): each student trains
  on that many buffer tasks per type, the last step's proposals first, whatever its teacher made. Buffer answers
  (``rollout.buffer_task_n`` each) train the student but never touch the teacher's reward, s̄ or the ratings.
* The match outcome uses the solve rates on the teacher's valid tasks; a match without any valid task is a
  student win. Under ``matchmaking.outcome=learnable`` (default) an invalid proposal or a task nobody solved counts
  as solved, so only learnable tasks win games for a teacher (``populora.population.ratings.match_outcomes``).
* Valid tasks enter the buffers after they are solved, filtered by ``buffer.valid_program_filter`` on ``s̄``.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from populora_verl.advantage import group_keys, trrpp_advantages
from populora_verl.config import PopuLoRAConfig, load_config
from populora_verl.diagnostics.metrics import evolution_metrics, merge_metrics, pair_metrics
from populora_verl.reward.levels import solve_rate, teacher_reward
from populora_verl.step.compute import compare_to_plan, compute_plan, realised_compute
from populora_verl.step.metrics import proposal_outcome_metrics, proposal_validity_metrics, sample_metrics
from populora_verl.step.records import (
    BASE_POLICY,
    SEED,
    STUDENT,
    TEACHER,
    GenRequest,
    GenResponse,
    Sample,
    StepResult,
    TeacherRecord,
)

logger = logging.getLogger(__name__)

__all__ = ["GenRequest", "GenResponse", "Sample", "TeacherRecord", "StepResult", "PopulationStep", "BASE_POLICY"]


class PopulationStep:
    """The population step as phases with explicit data in and out (see the module docstring).

    Owns the population (members, ratings, lineage), the matchmaker, the PBT controller, the task buffers, the
    problem diagnostics (complexity + CVT coverage) and its own RNG; :meth:`state_dict` carries all of them but the
    population, which :mod:`populora_verl.checkpoint` saves with the adapters (``Population.save``).
    """

    def __init__(
        self,
        cfg: PopuLoRAConfig | Mapping[str, Any] | None = None,
        *,
        executor: Any = None,
        seed: int | None = None,
        population: Any = None,
        tasks_env: Any = None,
        total_steps: int | None = None,
    ) -> None:
        from populora_verl.diagnostics.tracker import ProblemDiagnostics
        from populora_verl.population import Matchmaker, Population

        self.cfg = cfg if isinstance(cfg, PopuLoRAConfig) else load_config(cfg)
        self.seed = int(self.cfg.population.seed if seed is None else seed)
        self.population = population if population is not None else Population.create(self.cfg)
        self.matchmaker = Matchmaker(self.cfg.matchmaking, seed=self.seed + 1)
        self.pbt = None
        if self.cfg.pbt.enabled:  # the config turns evolution off for the single agent
            from populora_verl.evolution.pbt import PBTController

            self.pbt = PBTController(self.cfg.pbt, seed=self.seed + 2, total_steps=total_steps)
            self.pbt.validate(self.cfg.population)
        from populora_verl.step.task_env import TaskEnv

        self.tasks = tasks_env if tasks_env is not None else TaskEnv(self.cfg, executor=executor)
        self.diagnostics = ProblemDiagnostics(
            self.cfg.diagnostics, seed=self.seed + 3, max_program_chars=self.cfg.tasks.max_program_chars
        )
        self._rng = np.random.Generator(np.random.PCG64(self.seed + 4))
        self.completed_step = 0  # the last step whose answers were scored (0 before the first)
        self.recent_rewards: dict[str, float] = {}
        self._phase = "idle"
        self._teacher_requests: list[GenRequest] = []
        self._teacher_records: list[TeacherRecord] = []
        self._answer_format_errors: list[bool] = []  # per answer of the step being scored
        self._student_requests: list[GenRequest] = []
        self._pairs: list[tuple[str, str]] = []
        self._current = 0
        # Optimizer steps an engine takes per adapter update (CPU driver: 1; verl: actor.ppo_epochs, one mini-batch).
        self.updates_per_step = 1
        bcfg = self.cfg.buffer
        # Seeding phase state: done when off, when a seed file filled the buffers, or once run (checkpointed).
        self.seeded = bcfg.seed_programs == 0 or bcfg.seed_file is not None
        self.seed_set: list[Any] = []  # the valid seeding proposals that entered the buffers (save_seed_file)
        self._seed_requests: list[GenRequest] = []
        self._seed_counts = {"rounds": 0, "proposals": 0, "valid": 0, "io": 0, "code_f": 0}
        self._pending_metrics: dict[str, float] = {}

    # --- phase 0: seeding (once, before step 1) --------------------------------------------------------------

    def _seed_missing(self) -> dict[str, int]:
        target = self.cfg.buffer.seed_programs
        types = self.cfg.tasks.types
        out = {}
        io = [t for t in ("code_o", "code_i") if t in types]
        if io:
            out["io"] = max(0, target - self._seed_counts["io"])
        if "code_f" in types:
            out["code_f"] = max(0, target - self._seed_counts["code_f"])
        return out

    def seed_begin(self) -> list[GenRequest]:
        """One round of the seeding phase (AZR): proposer prompts for the base model (``BASE_POLICY``), one answer
        each, as many as programs are still missing; ``[]`` once the buffers hold ``buffer.seed_programs`` of each
        or ``buffer.seed_rounds`` rounds are spent (training then starts with what was found)."""
        if self._phase != "idle":
            raise RuntimeError(f"PopulationStep.seed_begin: a step is in phase {self._phase!r}")
        missing = self._seed_missing()
        if self.seeded or self._seed_counts["rounds"] >= self.cfg.buffer.seed_rounds or not any(missing.values()):
            self._finish_seeding()
            return []
        io = [t for t in ("code_o", "code_i") if t in self.cfg.tasks.types]
        requests = []
        for i in range(missing.get("io", 0)):
            task_type = io[i % len(io)]  # alternate: one triplet seeds both io types
            prompt, meta = self.tasks.proposer_request(task_type, self._rng)
            requests.append(GenRequest(BASE_POLICY, SEED, task_type, prompt, 1, meta))
        for _ in range(missing.get("code_f", 0)):
            prompt, meta = self.tasks.proposer_request("code_f", self._rng)
            requests.append(GenRequest(BASE_POLICY, SEED, "code_f", prompt, 1, meta))
        self._seed_requests = requests
        self._phase = "seeding"
        return requests

    def seed_on_proposals(self, responses: Sequence[Any]) -> None:
        """Validate a seeding round; valid, new programs enter the buffers and :attr:`seed_set`."""
        if self._phase != "seeding":
            raise RuntimeError(f"PopulationStep.seed_on_proposals called in phase {self._phase!r}")
        responses = self._align(responses, self._seed_requests, "seed_on_proposals")
        verdicts = self.tasks.validate_many(
            [(r.request.task_type, text, r.request.meta, SEED, 0) for r in responses for text in r.texts]
        )
        valid = [v[0] for v in verdicts if v[0] is not None]
        added = self.tasks.add_seeds(valid)
        c = self._seed_counts
        c["rounds"] += 1
        c["proposals"] += len(verdicts)
        c["valid"] += len(valid)
        c["io"] += sum(1 for t in added if t.type != "code_f")
        c["code_f"] += sum(1 for t in added if t.type == "code_f")
        self.seed_set.extend(added)
        self._seed_requests = []
        self._phase = "idle"

    def _finish_seeding(self) -> None:
        if self.seeded:
            return
        self.seeded = True
        c = self._seed_counts
        # Logged with step 1's metrics (metrics.jsonl has one row per step).
        self._pending_metrics = {
            "populora/seeding/rounds": float(c["rounds"]),
            "populora/seeding/proposals": float(c["proposals"]),
            "populora/seeding/valid_rate": c["valid"] / c["proposals"] if c["proposals"] else 0.0,
            "populora/seeding/io_programs": float(c["io"]),
            "populora/seeding/code_f_tasks": float(c["code_f"]),
        }

    def set_total_steps(self, total_steps: int | None) -> None:
        """The run's last step, so that PBT keeps the final ``pbt.final_quiet_steps`` free of evolution."""
        if self.pbt is not None:
            self.pbt.total_steps = None if total_steps is None else int(total_steps)

    # --- phase 1: match + propose -------------------------------------------------------------------------

    def _task_types(self) -> list[str]:
        """The task type of each of a teacher's ``proposals_per_type x |types|`` prompts this step."""
        types = list(self.cfg.tasks.types)
        per = self.cfg.rollout.proposals_per_type
        if self.cfg.tasks.probabilities is None:
            return [t for t in types for _ in range(per)]
        p = np.asarray(self.cfg.tasks.probabilities, dtype=np.float64)
        draws = self._rng.choice(len(types), size=per * len(types), p=p / p.sum())
        return [types[i] for i in sorted(draws.tolist())]

    def begin(self, step: int) -> list[GenRequest]:
        """Match teachers with students and build the teacher (proposer) requests of step ``step``."""
        if self._phase != "idle":
            raise RuntimeError(f"PopulationStep.begin: previous step still in phase {self._phase!r}")
        if not self.seeded:
            raise RuntimeError("PopulationStep.begin: run the seeding phase first (seed_begin until it returns [])")
        waited = self.tasks.await_seed_file()  # buffer.seed_file_wait_s: another run's seed set
        if waited:
            logger.info("populora: step %d: %d seed tasks from %s", step, waited, self.cfg.buffer.seed_file)
        self._current = int(step)
        self._pairs = self.matchmaker.pairs(self.population, self._current)
        requests = []
        for teacher in self.population.teachers():
            for task_type in self._task_types():
                prompt, meta = self.tasks.proposer_request(task_type, self._rng)
                meta.update(teacher=teacher.id)
                requests.append(GenRequest(teacher.id, TEACHER, task_type, prompt, self.cfg.rollout.teacher_n, meta))
        self._teacher_requests = requests
        self._phase = "proposing"
        return requests

    # --- phase 2: validate -> student requests ------------------------------------------------------------

    def _align(self, responses: Sequence[Any], requests: Sequence[GenRequest], what: str) -> list[GenResponse]:
        """Accept ``GenResponse`` objects or bare lists of texts aligned with ``requests``."""
        if len(responses) != len(requests):
            raise ValueError(f"{what}: got {len(responses)} responses for {len(requests)} requests")
        out = []
        for req, r in zip(requests, responses):
            resp = r if isinstance(r, GenResponse) else GenResponse(req, list(r))
            if len(resp.texts) != req.n:
                raise ValueError(
                    f"{what}: request for {req.adapter}/{req.task_type} wanted {req.n} samples, got {len(resp.texts)}"
                )
            out.append(resp)
        return out

    def on_proposals(self, responses: Sequence[Any]) -> list[GenRequest]:
        """Validate each proposal through the executor; return the student (solver) requests."""
        if self._phase != "proposing":
            raise RuntimeError(f"PopulationStep.on_proposals called in phase {self._phase!r}")
        responses = self._align(responses, self._teacher_requests, "on_proposals")
        items = [(resp, k) for resp in responses for k in range(len(resp.texts))]
        verdicts = self.tasks.validate_many(
            [(r.request.task_type, r.texts[k], r.request.meta, r.request.adapter, self._current) for r, k in items]
        )
        records = [
            TeacherRecord(
                adapter=resp.request.adapter,
                task_type=resp.request.task_type,
                prompt=resp.request.prompt,
                response=resp.texts[k],
                length=resp.lengths[k] if resp.lengths else 1,
                extra=resp.extra[k] if resp.extra else None,
                task=task,
                status=status,
                code=why[0] if why else "",
            )
            for (resp, k), (task, status, *why) in zip(items, verdicts)
        ]
        self._teacher_records = records

        students_of: dict[str, list[str]] = {}
        for t, s in self._pairs:
            students_of.setdefault(t, []).append(s)
        n_ans = self.cfg.rollout.student_n
        n_buf = self.cfg.rollout.buffer_task_n or n_ans
        max_new = self.cfg.buffer.student_mix == "max_new"
        quota = self.cfg.rollout.teacher_n * self.cfg.rollout.proposals_per_type
        requests: list[GenRequest] = []
        for teacher in self.population.teachers():
            mine = [(i, r) for i, r in enumerate(records) if r.adapter == teacher.id]
            for s in students_of.get(teacher.id, []):
                for i, r in mine:
                    if r.task is not None:
                        requests.append(
                            GenRequest(
                                s,
                                STUDENT,
                                r.task.type,
                                self.tasks.solver_request(r.task),
                                n_ans,
                                {"task": r.task, "teacher": teacher.id, "record": i, "source": "teacher"},
                            )
                        )
                asked = sorted({r.task_type for _, r in mine})
                for task_type in asked:
                    if max_new:  # AZR's solver batch: newest buffer tasks first (last step's proposals)
                        tasks = self.tasks.buffer_tasks(task_type, quota, self._rng, since_step=self._current - 1)
                    else:  # stand-ins for the teacher's missing valid tasks
                        got = sum(1 for _, r in mine if r.task_type == task_type and r.has_task)
                        tasks = self.tasks.buffer_tasks(task_type, quota - got, self._rng)
                    for task in tasks:
                        requests.append(
                            GenRequest(
                                s,
                                STUDENT,
                                task_type,
                                self.tasks.solver_request(task),
                                n_buf,
                                {"task": task, "teacher": teacher.id, "record": None, "source": "buffer"},
                            )
                        )
        self._student_requests = requests
        self._phase = "solving"
        return requests

    # --- phase 3: score, assemble rewards, rate, advantages ------------------------------------------------

    def on_answers(self, responses: Sequence[Any]) -> StepResult:
        """Score the answers; assemble teacher rewards from matched students; rate matches; TRR++ advantages."""
        if self._phase != "solving":
            raise RuntimeError(f"PopulationStep.on_answers called in phase {self._phase!r}")
        rw = self.cfg.rewards
        responses = self._align(responses, self._student_requests, "on_answers")
        items = [(resp, k) for resp in responses for k in range(len(resp.texts))]
        scores = self.tasks.score_many([(r.request.meta["task"], r.texts[k]) for r, k in items])

        student_samples: list[Sample] = []
        # Every answer counts here, estimation answers that are not trained included: it is what the policy wrote.
        self._answer_format_errors = [status == "format_error" for _, _, status in scores]
        for (resp, k), (reward, correct, _) in zip(items, scores):
            req = resp.request
            if req.meta["record"] is not None:
                self._teacher_records[req.meta["record"]].solve.setdefault(req.adapter, []).append(bool(correct))
            if req.meta["source"] == "teacher" and not rw.train_on_estimation_rollouts:
                continue
            student_samples.append(
                Sample(
                    req.adapter,
                    STUDENT,
                    req.task_type,
                    req.prompt,
                    resp.texts[k],
                    float(reward),
                    length=resp.lengths[k] if resp.lengths else 1,
                    extra=resp.extra[k] if resp.extra else None,
                    meta={
                        "teacher": req.meta["teacher"],
                        "source": req.meta["source"],
                        "correct": bool(correct),
                        "task_id": req.meta["task"].id,
                    },
                )
            )

        # Teacher rewards: learnability of each valid task for its matched student(s).
        teacher_samples: list[Sample] = []
        pair_rates: dict[tuple[str, str], list[float]] = {p: [] for p in self._pairs}
        new_tasks = []
        for rec in self._teacher_records:
            task = rec.task
            if task is None:
                reward, rate = teacher_reward(rec.status, None, rw), None
            else:
                for s, c in rec.solve.items():
                    if c:
                        pair_rates.setdefault((rec.adapter, s), []).append(solve_rate(c))
                pooled = [c for cs in rec.solve.values() for c in cs]
                rate = solve_rate(pooled) if pooled else None
                if rec.status == "format_error":  # a valid program under a failed envelope (AZR): still -1
                    reward = teacher_reward("format_error", None, rw)
                else:  # no matched student answered (no students at all): the task taught nobody, reward Z
                    reward = (
                        teacher_reward("valid", rate, rw) if rate is not None else float(rw.zero_learnability_reward)
                    )
                new_tasks.append((task, rate))  # the buffer applies buffer.valid_program_filter
            teacher_samples.append(
                Sample(
                    rec.adapter,
                    TEACHER,
                    rec.task_type,
                    rec.prompt,
                    rec.response,
                    float(reward),
                    length=rec.length,
                    extra=rec.extra,
                    meta={"status": rec.status, "solve_rate": rate, "task_id": task.id if task else None},
                )
            )

        # Ratings: one match per (teacher, student) pair over the teacher's valid tasks (matchmaking.outcome
        # = learnable also counts the teacher's invalid proposals against it).
        invalid: dict[str, int] = {}
        for rec in self._teacher_records:
            invalid[rec.adapter] = invalid.get(rec.adapter, 0) + (not rec.has_task)
        outcomes = {}
        for (t, s), rates in pair_rates.items():
            outcomes[(t, s)] = self.population.ratings.rate_match(
                t, s, rates, self.cfg.matchmaking.outcome, invalid=invalid.get(t, 0)
            )
        solve_rates = {p: float(np.mean(r)) for p, r in pair_rates.items() if r}

        samples = teacher_samples + student_samples
        self._assign_advantages(samples)
        updates: dict[str, list[Sample]] = {m.id: [] for m in self.population.members}
        for smp in samples:
            updates.setdefault(smp.adapter, []).append(smp)

        # Complexity and coverage describe what teachers wrote: a code_f task's program is a buffer program the
        # teacher was shown (it only wrote inputs and a message), so it is left out.
        valid_programs = [
            r.task.program for r in self._teacher_records if r.task is not None and r.task.type != "code_f"
        ]
        self.tasks.add_to_buffers(new_tasks)
        metrics = self._metrics(samples, solve_rates, valid_programs)
        generated: dict[str, int] = {}
        for rec in self._teacher_records:
            generated[rec.adapter] = generated.get(rec.adapter, 0) + 1
        for resp, _ in items:
            generated[resp.request.adapter] = generated.get(resp.request.adapter, 0) + 1
        metrics.update(realised_compute(updates, generated, self.updates_per_step))
        # The plan next to what happened, per adapter: a mean on plan can hide one student trained twice and another
        # not at all.
        plan = compute_plan(self.cfg)
        metrics["populora/compute/planned_trajectories"] = plan.mean
        against_plan, off_plan = compare_to_plan(plan, {m.id: m.role for m in self.population.members}, updates)
        metrics.update(against_plan)
        if off_plan:
            logger.warning("populora: step %d: %s", self._current, off_plan)
        metrics.update(self._pending_metrics)
        self._pending_metrics = {}
        self.recent_rewards = {m: float(np.mean([x.reward for x in xs])) for m, xs in updates.items() if xs}
        for m in self.population.members:
            self.recent_rewards.setdefault(m.id, 0.0)
        self.completed_step = self._current
        self.population.step = self._current
        self.population.tick()  # every living member has trained one more step (after this step's update)
        self._phase = "idle"
        self._teacher_requests, self._student_requests, self._teacher_records = [], [], []
        return StepResult(self._current, samples, updates, metrics, solve_rates, outcomes)

    def _assign_advantages(self, samples: list[Sample]) -> None:
        """TRR++ per group (default: adapter x task type x role), whitened over response tokens as verl does."""
        if not samples:
            return
        width = max(max(1, s.length) for s in samples)
        rewards = torch.zeros(len(samples), width, dtype=torch.float64)
        mask = torch.zeros(len(samples), width, dtype=torch.float64)
        for i, s in enumerate(samples):
            n = max(1, s.length)
            mask[i, :n] = 1.0
            rewards[i, n - 1] = s.reward  # outcome reward on the last response token
        subpops = [self.population.member(s.adapter).role for s in samples]
        keys = group_keys(
            [s.adapter for s in samples],
            [s.task_type for s in samples],
            [s.role for s in samples],
            subpops,
            self.cfg.advantage.group,
        )
        adv, _ = trrpp_advantages(rewards, mask, keys, gamma=1.0, eps=self.cfg.advantage.eps)
        for i, s in enumerate(samples):
            # Reward only on the last token with gamma=1: the return, hence the advantage, is constant per sample.
            s.advantage = float(adv[i, 0])

    def _metrics(
        self, samples: Sequence[Sample], solve_rates: Mapping[tuple[str, str], float], valid_programs: Sequence[str]
    ) -> dict[str, float]:
        return merge_metrics(
            self.population.ratings.metrics(),
            pair_metrics(solve_rates),
            proposal_validity_metrics(self._teacher_records),
            proposal_outcome_metrics(self._teacher_records),
            self.diagnostics.observe(list(valid_programs), self._current),
            sample_metrics(samples, self._answer_format_errors),
            evolution_metrics(0),
        )

    # --- phase 4: evolve -----------------------------------------------------------------------------------

    def maybe_evolve(self, step: int, adapters: Mapping[str, Mapping[str, torch.Tensor]]) -> tuple[Any, dict]:
        """PBT when due at ``step``: ``(EvolutionPlan, {child_id: state_dict})``, else ``(None, {})``.

        The engine writes each child into ``Replacement.victim_slot`` and resets that slot's optimizer state where
        ``Replacement.reset_optimizer`` is set."""
        plan = self.plan_evolution(step)
        if plan is None:
            return None, {}
        children = self.pbt.apply(plan, self.population, adapters)
        self._forget_victims(plan)
        return plan, children

    def plan_evolution(self, step: int) -> Any:
        """The first half of :meth:`maybe_evolve` for an engine that makes the children itself (the verl workers):
        the ``EvolutionPlan`` when PBT is due at ``step``, else ``None``; nothing changes until
        :meth:`commit_evolution`."""
        if self.pbt is None or not self.pbt.due(step):
            return None
        recent = self.recent_rewards if self.cfg.pbt.fitness == "recent_reward" else None
        return self.pbt.plan(self.population, step, recent)

    def commit_evolution(self, plan: Any) -> None:
        """The second half: the plan's children are in their slots, so the population takes them (victims die,
        children are born with their ratings and lineage), as :meth:`maybe_evolve` does after making them."""
        self.pbt.commit(plan, self.population)
        self._forget_victims(plan)

    def _forget_victims(self, plan: Any) -> None:
        for r in plan.replacements:
            self.recent_rewards.pop(r.victim_id, None)
            self.recent_rewards[r.child_id] = 0.0

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything this object owns except the population (saved with the adapters)."""
        if self._phase != "idle":
            raise RuntimeError("PopulationStep.state_dict: save between steps, not in phase " + repr(self._phase))
        return {
            "step": self.completed_step,
            "seed": self.seed,
            "rng": self._rng.bit_generator.state,
            "matchmaker": self.matchmaker.state_dict(),
            "pbt": self.pbt.state_dict() if self.pbt is not None else None,
            "recent_rewards": dict(self.recent_rewards),
            "buffers": self.tasks.buffers_state(),
            "seeded": self.seeded,
            "coverage": self.diagnostics.archive.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], population: Any = None) -> None:
        if population is not None:
            self.population = population
            if self.pbt is not None:  # the window of this run's config (final_quiet_steps may change on resume)
                self.population.age_window = self.cfg.pbt.quiet_steps
        self.completed_step = int(state["step"])
        self.seed = int(state["seed"])
        self._rng = np.random.Generator(np.random.PCG64())
        self._rng.bit_generator.state = dict(state["rng"])
        self.matchmaker.load_state_dict(state["matchmaker"])
        if self.pbt is not None and state.get("pbt") is not None:
            self.pbt.load_state_dict(state["pbt"])
        self.recent_rewards = {k: float(v) for k, v in state.get("recent_rewards", {}).items()}
        self.tasks.load_buffers_state(state["buffers"])
        self.seeded = bool(state.get("seeded", True))  # checkpoints from before the seeding phase: trained already
        self.diagnostics.archive.load_state_dict(state["coverage"])
        self._phase = "idle"
