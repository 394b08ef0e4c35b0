"""The step's hooks around verl's loop: seeding and schedule switches before a step; after it, evolution, the stop
file, checkpoints (population, step state, bank, then verl's) and the metrics row; resume from a checkpoint."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import transfer_queue as tq
from omegaconf import open_dict

from populora_verl import verl_compat
from populora_verl.evolution.pbt import trim_events
from populora_verl.step.engine import Phase, evolve, seed_buffers, seed_file
from populora_verl.step.records import SEED, GenRequest, GenResponse
from populora_verl.trainer import schedule, stop, verl_config
from populora_verl.trainer.convert import PARTITION
from populora_verl.trainer.timeline import timed
from populora_verl.workers.adapter_bank import EVOLUTION_PHASES

logger = logging.getLogger(__name__)


class TrainerEngine:
    """The verl trainer as a :class:`~populora_verl.step.engine.PopulationEngine`, over its worker RPCs and its
    TransferQueue generation, and a :class:`~populora_verl.step.engine.PlanEngine`: the workers make evolution
    children where the adapters live, so the trainer has no ``write_child`` (a child state would cross processes
    for nothing); the workers' ``populora_set_adapter`` stays a worker API, not an engine one.

    Only the seeding phase generates through here: its rows are never trained on, so they leave TransferQueue at
    once. The step's teacher and student phases stay with :meth:`PopuLoRATrainer.step`, which trains on their rows
    and so needs their batch metadata, not just the texts.
    """

    def __init__(self, trainer: Any, metrics: dict[str, Any] | None = None) -> None:
        self._trainer = trainer
        self.metrics = {} if metrics is None else metrics  # the rollout metrics of what generate() ran

    def generate(self, requests: Sequence[GenRequest], phase: Phase) -> list[GenResponse]:
        if phase.name != SEED:
            raise ValueError(
                f"TrainerEngine generates the seeding phase only, not {phase.name!r}: the step's own "
                "phases are trained from their TransferQueue rows (PopuLoRATrainer.step)"
            )
        responses, batch, _ = self._trainer._generate(list(requests), phase.name, self.metrics)
        tq.kv_clear(keys=list(batch.keys), partition_id=PARTITION)  # never trained on
        return responses

    def get_adapter(self, slot: int) -> dict[str, torch.Tensor]:
        return self._trainer._get_adapter(int(slot))

    def apply_plan(self, entries: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """The event on the workers (``populora_apply_plan``); the seconds per phase of the slowest rank (the one
        whose phases add up to the most), so that the split adds up to no more than the event."""
        out = self._trainer.actor_rollout_wg.populora_apply_plan(list(entries))
        splits = [dict(o["timing"]) for o in (out if isinstance(out, list) else [out]) if o]
        if not splits:
            raise RuntimeError("populora_apply_plan returned nothing")
        return max(splits, key=lambda t: sum(t.values()))


#: The evolution event's key in verl's ``timing_raw`` (``timing_s/populora_evolve``); its phases are under it.
EVOLVE = "populora_evolve"


def evolution_line(step: int, children: int, timing_raw: Mapping[str, float]) -> str | None:
    """``[populora] evolution at step N: 2 children in X s (operator a, gather b, scatter c, optimizer d)`` from
    ``timing_raw`` (the event's total and its phases), or ``None`` when the step made no child."""
    if children <= 0 or EVOLVE not in timing_raw:
        return None
    split = ", ".join(
        f"{p} {timing_raw[f'{EVOLVE}/{p}']:.2f}" for p in EVOLUTION_PHASES if f"{EVOLVE}/{p}" in timing_raw
    )
    return (
        f"[populora] evolution at step {step}: {children} {'child' if children == 1 else 'children'} in "
        f"{timing_raw[EVOLVE]:.2f} s" + (f" ({split})" if split else "")
    )


class HooksMixin:
    """verl's step-boundary hooks: what happens before and after a step, and checkpoint save and load.
    Mixed into :class:`~populora_verl.trainer.trainer.PopuLoRATrainer`."""

    def on_step_begin(self) -> None:
        self._mark("agent loop", after="checkpoint + weight sync")
        idx = schedule.starts(self._schedule).get(self.global_steps)
        if idx:  # a later entry of a population schedule starts with this step (entry 0 is set up by init)
            with timed("populora_switch", self.timing_raw, color="green"):
                schedule.switch_population(self, idx)
        if not self.pop_step.seeded:  # buffer.seed_programs > 0 on a fresh run (or entry)
            self._seed_buffers()
        if self.debug_probes:
            self._probe_adapters()

    def _seed_buffers(self) -> None:
        """The seeding phase (``populora.buffer.seed_programs``) before step 1: the base policy proposes until the
        buffers hold the target; nothing of it is trained. The seed set goes to ``<default_local_dir>/seed_tasks.jsonl``
        (reuse it with ``populora.buffer.seed_file``)."""
        run_dir = self._step_folder().rsplit(os.sep, 1)[0]
        rounds = seed_buffers(self.pop_step, TrainerEngine(self), run_dir)
        if rounds:
            print(
                f"[populora] seeding: {rounds} rounds, {len(self.pop_step.seed_set)} seed tasks -> "
                f"{seed_file(run_dir)}",
                flush=True,
            )

    def _end_step(self, metrics: dict) -> None:
        """The end of :meth:`step`, after the update: the stop file, evolution (PBT) and the step's population
        metrics. In ``step`` rather than ``on_step_end``: verl's loop saves its checkpoint between the two, and the
        checkpoint must hold the evolved population (children and their optimizer state) that the next step serves.
        Evolution's metrics join the step's own row."""
        ending = self._stop_due()
        with timed(EVOLVE, self.timing_raw, color="green"):
            evo = {} if ending else self._evolve()
        line = evolution_line(self.global_steps, int(evo.get("populora/evolution/events", 0)), self.timing_raw)
        if line:
            print(line, flush=True)
        if ending:
            # fit() leaves its loop once global_steps passes total_training_steps: this step is the last one. verl
            # decided whether to save this step before it ran, so on_step_end saves it when verl does not.
            self._stop_save = True
            self.total_training_steps = self.global_steps
            print(
                f"[populora] step {self.global_steps}: stop file {self._stop_path} found; no evolution, "
                f"checkpoint, then the run ends",
                flush=True,
            )
        step_metrics = self._step_population_metrics
        if step_metrics is not None:
            self._log_population_metrics({**step_metrics, **evo}, self.global_steps)
            self._step_population_metrics = None
        metrics.update(evo)

    def on_step_end(self) -> None:
        if not self._timeline_done and self._timeline.marks and self._timeline.marks[-1][0] == "agent loop":
            self._timeline.mark(f"step {self.global_steps}")
            print(self._timeline.line(), flush=True)
        self._timeline_done = True
        if self._stop_save and self._saved_step != self.global_steps:
            with timed("save_checkpoint", self.timing_raw, color="green"):
                if verl_compat.has_public_save():
                    self.save_checkpoint()
                else:
                    verl_compat.private_path("_save_checkpoint")
                    self._save_checkpoint()
        self._stop_save = False
        if self._saved_step == self.global_steps:
            self._after_save()
        # Weight sync last: it pushes every slot (children included) to vLLM under its current LoRA id.
        super().on_step_end()

    def _stop_due(self) -> bool:
        request = stop.read_request(self._stop_path)
        if request is None:
            return False
        pop = self.pop_step.population
        ages = [int(m.age) for m in pop.members]
        window = pop.age_window if self.pop_step.pbt is not None else None
        return stop.due(request, self.global_steps, min(ages) if ages else None, window)

    def _evolve(self) -> dict[str, float]:
        evolution = evolve(self.pop_step, self.global_steps, TrainerEngine(self), self.config.trainer.default_local_dir)
        for line in evolution.lines:
            print(line, flush=True)
        for phase, seconds in evolution.timing.items():  # verl logs them as timing_s/populora_evolve/<phase>
            self.timing_raw[f"{EVOLVE}/{phase}"] = float(seconds)
        return evolution.metrics

    def on_save_checkpoint(self, checkpoint_dir: str) -> None:
        # verl's save calls it (0008) before marking the step saved; on verl 0.9.1 PopuLoRATrainer._save_checkpoint
        # calls it before verl's save
        self._save_population(checkpoint_dir)
        self._saved_step = self.global_steps

    def _step_folder(self, for_load: bool = False) -> str:
        if for_load and self.config.trainer.resume_mode == "resume_path":
            folder = self.config.trainer.resume_from_path
        else:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)

    def _save_population(self, step_dir: str) -> None:
        """The population, the step's state and every slot's adapter and optimizer (the bank) under
        ``<step_dir>/populora``, before the step counts as saved."""
        from populora_verl.checkpoint import save_checkpoint

        pdir = os.path.join(step_dir, "populora")
        written = self.actor_rollout_wg.populora_save_bank(os.path.join(pdir, "bank"))
        verl_config.warn_if_bank_not_shared(written)  # M nodes: every rank's file must be where the driver resumes
        pop = self.pop_step.population
        adapters = {m.id: self._get_adapter(int(m.slot)) for m in pop.members}
        save_checkpoint(
            pdir,
            self.global_steps,
            population=pop,
            adapters=adapters,
            lora_config=self._lora_config(),
            optimizers={},
            step_state=self.pop_step.state_dict(),
            extra={
                "bank": "bank",
                "adapter_layout": self.pcfg.population.adapter_layout,
                "bank_info": self._bank_info(),
            },
        )

    def _after_save(self) -> None:
        """Once the step is marked saved: say so, and prune old step folders (only now, so the folder the tracker
        pointed at until this save is never removed before the new one is complete)."""
        from populora_verl.trainer.resume import prune_step_folders

        print(
            f"[populora] step {self.global_steps}: checkpoint {os.path.join(self._step_folder(), 'populora')}",
            flush=True,
        )
        for folder in prune_step_folders(
            os.path.dirname(self._step_folder()), self.config.trainer.get("max_actor_ckpt_to_keep", None)
        ):
            print(f"[populora] removed old checkpoint {folder} (trainer.max_actor_ckpt_to_keep)", flush=True)

    def before_load_checkpoint(self) -> None:
        """Before verl's resume (its hook, or the start of our ``_load_checkpoint`` on a verl without it): the adapter
        bank is built, and the resume is pointed at the newest checkpoint that passes our checks."""
        self._mark("workers + vLLM")
        info = self._rpc(
            "populora_init_bank",
            self.pcfg.population.num_adapters,
            self.pcfg.population.seed,
            shared_a=self.pcfg.population.founder_init == "shared_a",
            layout=self.pcfg.population.adapter_layout,
        )
        logger.info("populora: adapter bank initialised: %s", info)
        self._resume_ck = None
        root = self.config.trainer.default_local_dir
        root = root if os.path.isabs(root) else os.path.join(os.getcwd(), root)
        mode = self.config.trainer.resume_mode
        if mode == "auto":
            # Check the newest checkpoint before verl loads it; fall back to an older one if it is damaged.
            from populora_verl.trainer.resume import choose_resume_folder, tracked_folder

            folder, self._resume_ck = choose_resume_folder(root)
            if folder is not None and folder != tracked_folder(root):
                with open_dict(self.config):
                    self.config.trainer.resume_mode = "resume_path"
                    self.config.trainer.resume_from_path = str(folder)
        from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

        if mode == "disable" or (self.config.trainer.resume_mode == "auto" and find_latest_ckpt_path(root) is None):
            # verl will start from step 0 (its own test, above) and call no load hook: evolution.jsonl starts empty
            trim_events(self.config.trainer.default_local_dir, 0)

    def on_load_checkpoint(self, checkpoint_dir: str) -> None:
        """After verl's resume from ``checkpoint_dir`` (its hook, or our ``_load_checkpoint``): the population, step
        state, RNG and adapter bank of that step."""
        # evolution.jsonl keeps what happened up to the step this run starts from (as metrics.jsonl does)
        trim_events(self.config.trainer.default_local_dir, self.global_steps)
        from populora_verl.checkpoint import load_checkpoint, restore_rng_state

        pdir = os.path.join(checkpoint_dir, "populora")
        if not os.path.isdir(pdir):
            raise RuntimeError(
                f"resuming step {self.global_steps} but {pdir} is missing: without the population and "
                "adapter bank the run would silently restart from fresh adapters"
            )
        ck = self._resume_ck if self._resume_ck is not None else load_checkpoint(pdir)
        self._resume_ck = None
        self.pop_step.load_state_dict(ck.step_state, population=ck.population)
        if ck.rng:
            restore_rng_state(ck.rng)
        self._rpc("populora_load_bank", os.path.join(pdir, "bank"), layout=self.pcfg.population.adapter_layout)
        print(f"[populora] resumed step {self.global_steps} from {pdir}", flush=True)

    def _log_population_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """``<trainer.default_local_dir>/metrics.jsonl`` (docs/CONTRACTS.md), the file the plots and report read."""
        try:
            if self._metrics_log is None:
                from populora_verl.diagnostics.metrics import MetricsLogger

                self._metrics_log = MetricsLogger(self._step_folder().rsplit(os.sep, 1)[0], resume_step=step - 1)
            self._metrics_log.log({k: v for k, v in metrics.items() if k.startswith("populora/")}, step)
        except Exception as e:  # the metrics file must never stop training
            logger.warning("populora: metrics.jsonl not written: %s", e)
