"""The single-process CPU driver: HF transformers + PEFT around :class:`populora_verl.step.PopulationStep`.

A test bed, not a second product: matchmaking, prompts, validation, rewards, ratings, advantages and evolution all
come from the shared components; this file only generates, trains, checkpoints and logs.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from populora_verl.checkpoint import (
    Checkpoint,
    CheckpointError,
    capture_rng_state,
    latest_checkpoint,
    load_latest_checkpoint,
    prune_checkpoints,
    restore_rng_state,
    save_checkpoint,
)
from populora_verl.config import PopuLoRAConfig, to_dict
from populora_verl.evolution.pbt import trim_events
from populora_verl.local.config import LocalConfig
from populora_verl.local.hf_engine import HFEngine, seed_for, slot_name
from populora_verl.local.progress import step_line
from populora_verl.step import PopulationStep, StepResult, check_compute_plan
from populora_verl.step.engine import EvolutionResult, Phase, evolve, seed_buffers, seed_file
from populora_verl.step.records import BASE_POLICY, SEED, STUDENT, TEACHER, GenRequest, GenResponse

__all__ = ["LocalDriver", "LocalEngine", "load_model"]

log = logging.getLogger(__name__)


def load_model(
    model_path: str | None = None, gguf: str | None = None, *, seed: int = 0, dtype: str = "float32"
) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the embedded tiny model, a local HF model folder, or a GGUF file (needs ``gguf``)."""
    if model_path is None and gguf is None:
        from populora_verl.local.tiny import build_tiny

        return build_tiny(seed=seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise FileNotFoundError(f"--gguf: no such file {gguf}")
        kw = dict(gguf_file=path.name)
        tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), torch_dtype=torch_dtype, **kw)
    else:
        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"--model: no such directory {model_path}")
        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(
                f"--model: {model_path} holds no HF model (no config.json); convert a GGUF with "
                "`python -m populora_verl.models convert` or pass --gguf"
            )
        tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch_dtype)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok


class LocalEngine:
    """The CPU driver as a :class:`~populora_verl.step.engine.PopulationEngine`: member slots to PEFT adapter names,
    phases to the generation seed of :func:`seed_for`. Also a :class:`~populora_verl.step.engine.ChildWriter`: every
    adapter already lives in this process, so PBT makes the children here and they go in through the per-slot AdamW
    states."""

    def __init__(self, hf: HFEngine, slot_of: Callable[[str], str], seed: int) -> None:
        self.hf, self._slot_of, self._seed = hf, slot_of, int(seed)

    def generate(self, requests: Sequence[GenRequest], phase: Phase) -> list[GenResponse]:
        # Seeding runs before step 1 and counts its rounds as phases of step 0; a step has a teacher and a student
        # phase. Each phase's seed depends on nothing else, so generation replays exactly after a resume.
        if phase.name == SEED:
            seed = seed_for(self._seed, 0, phase.round)
        else:
            seed = seed_for(self._seed, phase.step, 1 if phase.name == STUDENT else 0)
        return self.hf.generate(requests, self._slot_of, seed)

    def get_adapter(self, slot: int) -> dict[str, torch.Tensor]:
        return self.hf.get_adapter(slot_name(slot))

    def write_child(self, slot: int, state: Mapping[str, torch.Tensor], optimizer_from: int | None) -> None:
        # The source's state is read before this slot's optimizer is replaced: a load over a fresh AdamW.
        moments = None if optimizer_from is None else self.hf.optimizer_state(slot_name(optimizer_from))
        name = slot_name(slot)
        self.hf.set_adapter(name, state)
        if moments is None:
            self.hf.reset_optimizer(name)
        else:
            self.hf.load_optimizer_state(name, moments)


class LocalDriver:
    """Runs PopuLoRA steps on one CPU process and keeps ``run_dir`` (metrics, tb, plots, checkpoints) up to date."""

    def __init__(
        self,
        cfg: PopuLoRAConfig,
        local: LocalConfig,
        run_dir: str | Path,
        *,
        model: Any = None,
        tokenizer: Any = None,
        model_path: str | None = None,
        gguf: str | None = None,
        resume: bool = False,
        executor: Any = None,
    ) -> None:
        self.cfg, self.local = cfg, local
        self.run_dir = Path(run_dir)
        from populora_verl.runlock import claim_run_dir

        # One writer per run directory: a second run here would interleave metrics and race on checkpoints.
        self._lock = claim_run_dir(self.run_dir, what="--run-dir")
        try:
            self._start(cfg, local, model, tokenizer, model_path, gguf, resume, executor)
        except BaseException:
            self._lock.abandon()  # a failed start leaves no debris: a folder this run created goes with its lock
            raise

    def _start(
        self,
        cfg: PopuLoRAConfig,
        local: LocalConfig,
        model: Any,
        tokenizer: Any,
        model_path: str | None,
        gguf: str | None,
        resume: bool,
        executor: Any,
    ) -> None:
        check_compute_plan(cfg)  # the verl trainer's start-up check: a plan not matched per adapter never starts
        ckpt = latest_checkpoint(self.run_dir)
        if resume and ckpt is None:
            # Starting fresh here would silently throw away what the user meant to continue.
            raise CheckpointError(
                f"--resume: no complete checkpoint in {self.run_dir / 'checkpoints'}; drop --resume "
                "to start a new run there"
            )
        if ckpt is not None and not resume:
            # A fresh run here would interleave its metrics and checkpoints with the old run's.
            raise FileExistsError(
                f"run dir {self.run_dir} already holds a run (checkpoint {ckpt.name}): pass "
                "--resume to continue it, or choose another --run-dir"
            )
        # On --resume, find a checkpoint that loads before spending time on the model.
        resumed = load_latest_checkpoint(self.run_dir) if resume else None
        self.seed = int(cfg.population.seed)
        # Everything below that draws from the global RNGs (LoRA init) is reproducible from the seed.
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)
        torch.manual_seed(self.seed)
        if model is None:
            model, tokenizer = load_model(model_path, gguf, seed=self.seed, dtype=local.dtype)
        self.base_model_path = self._base_model_path(model, tokenizer, model_path, gguf)
        self.step_obj = PopulationStep(cfg, executor=executor, seed=self.seed)
        # rollout.max_new_tokens / temperature null: the CPU driver's own defaults.
        self.engine = HFEngine(
            model,
            tokenizer,
            num_slots=len(self.step_obj.population.members),
            cfg=local,
            temperature=1.0 if cfg.rollout.temperature is None else cfg.rollout.temperature,
            max_new_tokens=cfg.rollout.max_new_tokens or 1024,
            shared_a=cfg.population.founder_init == "shared_a",
        )
        self.pop_engine = LocalEngine(self.engine, self.slot_of, self.seed)  # what the shared step code drives
        self.start_step = 0
        if resumed is not None:
            self._restore(resumed)
        else:
            self._write_config()
        trim_events(self.run_dir, self.start_step)
        from populora_verl.diagnostics.metrics import MetricsLogger

        self.logger = MetricsLogger(
            self.run_dir, tensorboard=local.tensorboard and _has_tensorboard(), resume_step=self.start_step
        )
        self.history: list[dict[str, float]] = []

    # --- state ------------------------------------------------------------------------------------------

    @property
    def population(self) -> Any:
        return self.step_obj.population

    def slot_of(self, member_id: str) -> str:
        if member_id == BASE_POLICY:
            return "__base__"  # PEFT's name for "no adapter" in a mixed-adapter batch
        return slot_name(self.population.member(member_id).slot)

    def adapters(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{member id: LoRA state dict}`` of the living members."""
        return {m.id: self.engine.get_adapter(slot_name(m.slot)) for m in self.population.members}

    def _base_model_path(self, model: Any, tokenizer: Any, model_path: str | None, gguf: str | None) -> str | None:
        """Where the saved adapters' base model lives (their ``base_model_name_or_path``), so ``populora-eval
        --run-dir`` and ``PeftModel.from_pretrained`` find it. The embedded tiny model exists only in memory: it is
        written once to ``<run_dir>/base_model`` (a few MB)."""
        if model_path is not None:
            return str(Path(model_path).resolve())
        if gguf is not None:
            return None  # a GGUF-loaded model cannot be saved; convert it with `python -m populora_verl.models`
        out = self.run_dir / "base_model"
        if not (out / "config.json").exists():
            tmp = self.run_dir / "base_model.tmp"
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # a 1-shard progress bar for a few MB only clutters the first screen
            try:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
            finally:
                hf_logging.enable_progress_bar()
            tmp.rename(out)
        return str(out.resolve())

    def _write_config(self) -> None:
        import yaml

        with open(self.run_dir / "config.yaml", "w") as f:
            yaml.safe_dump({"populora": to_dict(self.cfg), "local": to_dict(self.local)}, f, sort_keys=False)

    def save(self, step: int) -> Path:
        optim = {m.id: self.engine.optimizer_state(slot_name(m.slot)) for m in self.population.members}
        lora_config = dict(self.engine.lora_config_dict(), base_model_name_or_path=self.base_model_path)
        path = save_checkpoint(
            self.run_dir,
            step,
            population=self.population,
            adapters=self.adapters(),
            lora_config=lora_config,
            optimizers=optim,
            step_state=self.step_obj.state_dict(),
            rng=capture_rng_state(),
        )
        if self.local.keep_checkpoints:
            prune_checkpoints(self.run_dir, self.local.keep_checkpoints)
        return path

    def _restore(self, ck: Checkpoint) -> None:
        path = ck.path
        members = ck.population.members
        if len(members) != len(self.engine.slots):
            raise ValueError(
                f"checkpoint {path} has {len(members)} members, this run has {len(self.engine.slots)} "
                "slots: resume with the same population size"
            )
        self.step_obj.load_state_dict(ck.step_state, population=ck.population)
        for m in members:
            slot = slot_name(m.slot)
            self.engine.set_adapter(slot, ck.adapters[m.id])
            if m.id in ck.optimizers:
                self.engine.load_optimizer_state(slot, ck.optimizers[m.id])
            else:
                self.engine.reset_optimizer(slot)
        if ck.rng is not None:
            restore_rng_state(ck.rng)
        self.start_step = ck.step
        log.info("resumed from %s (step %d)", path, ck.step)

    # --- seeding and one step ----------------------------------------------------------------------------

    def seed_buffers(self) -> int:
        """The seeding phase (``buffer.seed_programs``): the base model proposes until the buffers hold the target;
        the seed set is written to ``<run_dir>/seed_tasks.jsonl`` (reuse it with ``buffer.seed_file``)."""
        rounds = seed_buffers(self.step_obj, self.pop_engine, self.run_dir)
        if rounds:
            log.info(
                "seeding: %d rounds, %d seed tasks -> %s", rounds, len(self.step_obj.seed_set), seed_file(self.run_dir)
            )
        return rounds

    # --- one step ---------------------------------------------------------------------------------------

    def run_step(self, step: int) -> tuple[StepResult, dict[str, float]]:
        """Generate, score, update every adapter, maybe evolve; returns the result and the logged metrics."""
        ps, eng = self.step_obj, self.engine
        t0 = time.perf_counter()
        proposals = self.pop_engine.generate(ps.begin(step), Phase(TEACHER, step))
        t1 = time.perf_counter()
        answers = self.pop_engine.generate(ps.on_proposals(proposals), Phase(STUDENT, step))
        t2 = time.perf_counter()
        result = ps.on_answers(answers)
        t3 = time.perf_counter()
        metrics = dict(result.metrics)
        for m in self.population.members:  # slot order: deterministic
            stats = eng.update(slot_name(m.slot), result.updates.get(m.id, []))
            for k, v in stats.items():
                metrics[f"populora/train/{m.id}/{k}"] = v
        t4 = time.perf_counter()
        # RUN/STOP, as in the verl trainer: a safe step ends the run, with no evolution and a checkpoint.
        self.stopping = self._stop_due(step)
        evolution = EvolutionResult() if self.stopping else evolve(ps, step, self.pop_engine, self.run_dir)
        self.last_plan = evolution.plan  # for the step line, which names the replacements
        metrics.update(evolution.metrics)
        for line in evolution.lines:  # the verl trainer's lines, with the tie-break notes the step line leaves out
            log.debug(line)
        metrics.update(
            {
                "populora/time/propose_s": t1 - t0,
                "populora/time/solve_s": t2 - t1,
                "populora/time/score_s": t3 - t2,
                "populora/time/update_s": t4 - t3,
                "populora/time/step_s": time.perf_counter() - t0,
            }
        )
        return result, metrics

    def _stop_due(self, step: int) -> bool:
        from populora_verl.trainer import stop

        request = stop.read_request(str(self.run_dir / "STOP"))
        if request is None:
            return False
        ages = [int(m.age) for m in self.population.members]
        window = self.population.age_window if self.step_obj.pbt is not None else None
        return stop.due(request, step, min(ages) if ages else None, window)

    def run(self, steps: int | None = None) -> list[dict[str, float]]:
        """Run up to step ``steps`` (total, counting resumed ones), or to the first safe step once ``RUN/STOP``
        exists; checkpoint, log, plot at the end."""
        total = self.local.steps if steps is None else int(steps)
        if (self.run_dir / "STOP").exists():  # a stop file left from an earlier run would end this one early
            log.info(
                "stop file %s exists: the run ends at its first safe step (remove it to run on)", self.run_dir / "STOP"
            )
        self.step_obj.set_total_steps(total)  # no evolution in the last pbt.final_quiet_steps steps
        bar = None
        if self.local.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, initial=self.start_step, desc="populora", unit="step", dynamic_ncols=True)
        step = self.start_step
        try:
            self.seed_buffers()  # no-op unless buffer.seed_programs > 0 on a fresh run
            for step in range(self.start_step + 1, total + 1):
                result, metrics = self.run_step(step)
                self.history.append(self.logger.log(metrics, step))
                # One line per step a user can follow (populora_verl.local.progress); -q drops only the bar.
                line = step_line(step, total, result, metrics, self.population, self.last_plan)
                bar.write(line) if bar is not None else print(line, flush=True)
                every = self.local.save_every
                if (every and step % every == 0) or step == total or self.stopping:
                    self.save(step)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        valid=f"{metrics.get('populora/validity/mean', 0):.2f}",
                        acc=f"{metrics.get('populora/student/accuracy', 0):.2f}",
                        evo=int(metrics.get("populora/evolution/events", 0)),
                    )
                if self.stopping:
                    log.info(
                        "step %d: stop file %s found; no evolution, checkpoint, then the run ends",
                        step,
                        self.run_dir / "STOP",
                    )
                    break
        finally:
            if bar is not None:
                bar.close()
            self.logger.close()
        if self.cfg.diagnostics.plots and (self.run_dir / "metrics.jsonl").exists():
            from populora_verl.diagnostics.plots import plot_all

            # The summary lists the plots drawn; a note per plot without data yet (complexity, on the tiny model
            # always) would read as a fault on a first run.
            notes = logging.getLogger("populora_verl.diagnostics.plots")
            level = notes.level
            notes.setLevel(logging.WARNING)
            try:
                plot_all(self.run_dir / "metrics.jsonl", self.run_dir / "plots")
            finally:
                notes.setLevel(level)
        return self.history

    def close(self) -> None:
        """Close the logs and the executor, then free the run directory for the next run."""
        try:
            self.logger.close()
            self.step_obj.tasks.close()
        finally:
            self._lock.release()


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        log.warning("tensorboard is not installed: metrics go to metrics.jsonl only")
        return False
    return True
