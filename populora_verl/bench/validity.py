"""Validity probe: how often a model writes usable proposals, why the others fail, and how often it solves.

    python -m populora_verl.bench.validity --model /path/to/Qwen2.5-Coder-1.5B-Instruct \\
        --lengths 1024 --temperatures 1.0 --proposals 64 --out /tmp/validity

For every setting (model x template x answer length x temperature) and every task type it asks the model for
``--proposals`` teacher proposals, validates them exactly as training does (the proposer prompts of
:class:`~populora_verl.step.task_env.TaskEnv`, :func:`~populora_verl.tasks.validate_proposal`, the sandboxed
executor), counts the failures by reason, then asks the same model ``--student-n`` answers to every valid task
and to every seed task (:meth:`TaskEnv.solver_request`, :meth:`TaskEnv.score_many`). One engine is built per
model and serves all of that model's settings.

Templates: ``azr`` and ``chat`` are the values of ``populora.tasks.prompt_template`` and mean exactly what training
sends for them (:func:`populora_verl.tasks.prompts.encode_prompt`): ``azr`` the plain-text conversation ending with
``Assistant: <think>``, ``chat`` the question and the format note in one user message inside the tokenizer's chat
template. The default is what training sends by default (``azr``). ``azr-in-chat`` is not a training template: the
plain ``azr`` text wrapped in one chat turn, a form some agent loops produce from a text prompt, kept for
comparison with measurements taken that way.

Engines: ``vllm`` (offline ``LLM.generate``, one engine per model; run with ``VLLM_WORKER_MULTIPROC_METHOD=spawn``)
and ``hf`` (transformers ``generate``; CPU friendly, used by the tests). Stop tokens are the tokenizer's EOS plus
the model's ``generation_config`` EOS ids (an instruct model ends its turn with ``<|im_end|>``).

Writes ``results.md`` (one table row per setting and task type) and ``results.json`` (counts, reasons, a few
example responses per failure reason) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

__all__ = [
    "Setting",
    "Generation",
    "HFProbeEngine",
    "VLLMProbeEngine",
    "failure_reason",
    "run_setting",
    "render_table",
    "main",
    "TEMPLATES",
    "DEFAULT_SEED_FILE",
]

#: What each name feeds the model: the training templates by their config names, plus one comparison form.
TEMPLATES = ("azr", "chat", "azr-in-chat")
TRAINING_TEMPLATES = ("azr", "chat")
DEFAULT_SEED_FILE = str(Path(__file__).resolve().parents[1] / "data" / "azr_seed.jsonl")
EXAMPLES_PER_REASON = 2
EXAMPLE_CHARS = 1500


@dataclass(frozen=True)
class Setting:
    model: str
    template: str
    max_tokens: int
    temperature: float
    prompt_file: str | None = None  # populora.tasks.prompt_file of this setting; None: the default wording

    @property
    def label(self) -> str:
        words = f" {Path(self.prompt_file).stem}" if self.prompt_file else ""
        return f"{Path(self.model).name} {self.template}{words} {self.max_tokens} T={self.temperature:g}"


@dataclass
class Generation:
    text: str
    tokens: int
    hit_cap: bool  # stopped at max_tokens rather than at a stop token


class ProbeEngine(Protocol):
    tokenizer: Any

    def generate(
        self, prompts: Sequence[list[int]], *, max_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[Generation]: ...


# --- engines ---------------------------------------------------------------------------------------------------


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The tokenizer's EOS plus every EOS id of the model's generation config, without duplicates."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.extend(int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return list(dict.fromkeys(ids))


def _generation_config(model_path: str) -> Any:
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):  # a folder without generation_config.json
        return None


class HFProbeEngine:
    """transformers ``generate`` in left-padded batches (sampling when ``temperature > 0``)."""

    def __init__(
        self,
        model_path: str,
        *,
        batch_size: int = 16,
        dtype: str = "auto",
        device: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if model is None:
            torch_dtype = getattr(torch, dtype) if dtype != "auto" else "auto"
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self.model = model.to(self.device).eval()
        self.batch_size = batch_size
        self.stop_ids = stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    def generate(
        self, prompts: Sequence[list[int]], *, max_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[Generation]:
        import torch

        pad = self.tokenizer.pad_token_id
        out: list[Generation] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), self.batch_size):
                batch = [list(p) for p in prompts[start : start + self.batch_size]]
                width = max(len(p) for p in batch)
                ids = torch.full((len(batch), width), pad, dtype=torch.long)
                attn = torch.zeros((len(batch), width), dtype=torch.long)
                for j, p in enumerate(batch):
                    ids[j, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                    attn[j, width - len(p) :] = 1
                kwargs: dict[str, Any] = dict(
                    max_new_tokens=max_tokens, pad_token_id=pad, eos_token_id=self.stop_ids, do_sample=temperature > 0
                )
                if temperature > 0:
                    kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
                with torch.no_grad():
                    gen = self.model.generate(
                        input_ids=ids.to(self.device), attention_mask=attn.to(self.device), **kwargs
                    )
                for row in gen[:, width:].tolist():
                    stop = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
                    resp = row[:stop] if stop is not None else row
                    out.append(
                        Generation(
                            self.tokenizer.decode(resp, skip_special_tokens=True),
                            len(resp),
                            stop is None and len(row) >= max_tokens,
                        )
                    )
        return out


class VLLMProbeEngine:
    """vLLM offline ``LLM.generate`` on token ids; one engine serves every setting of its model."""

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int,
        gpu_memory_utilization: float = 0.85,
        dtype: str = "auto",
        enforce_eager: bool = False,
        seed: int = 0,
    ) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            enforce_eager=enforce_eager,
            seed=seed,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.stop_ids = stop_token_ids(self.tokenizer, _generation_config(model_path))

    def generate(
        self, prompts: Sequence[list[int]], *, max_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[Generation]:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=temperature,
            top_p=top_p if temperature > 0 else 1.0,
            max_tokens=max_tokens,
            stop_token_ids=self.stop_ids,
            n=1,
        )
        # No per-request seed: repeated prompts (a task's student answers) must be independent samples; the
        # engine's own seed keeps the run reproducible.
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            gens.append(Generation(c.text, len(c.token_ids), c.finish_reason == "length"))
        return gens


# --- prompts ---------------------------------------------------------------------------------------------------


def encode_prompt(tokenizer: Any, prompt: Any, template: str, max_prompt_tokens: int) -> list[int]:
    """Token ids the model sees for a rendered prompt (see the module docstring): training's own encoder
    (:func:`populora_verl.tasks.prompts.encode_prompt`) for ``azr`` and ``chat``; ``azr-in-chat`` wraps the plain
    ``azr`` text in one chat turn first."""
    if template == "azr-in-chat":
        from populora_verl.trainer.convert import prompt_to_messages

        prompt = prompt_to_messages(prompt)
    from populora_verl.tasks.prompts import encode_prompt as training_encode

    return training_encode(tokenizer, prompt)[-max_prompt_tokens:]


# --- failure reasons -------------------------------------------------------------------------------------------

# (substring of the validator's reason, lower-cased -> category). Execution sub-kinds come before the generic
# "execution failed"; unknown reasons are kept verbatim under "other: ...", so a reworded validator still reports.
_REASON_RULES: tuple[tuple[str, str], ...] = (
    ("no python block", "missing program block"),
    ("no input block", "missing input block"),
    ("no message block", "missing message block"),
    ("banned", "banned import"),
    ("timeout", "timeout"),
    ("timed out", "timeout"),
    ("nondetermin", "nondeterministic"),
    ("memory", "out of memory"),
    ("output too large", "output too large"),
    ("syntax error", "parse error"),
    ("does not tokenize", "parse error"),
    ("not a valid argument list", "bad input"),
    ("empty input", "bad input"),
    ("plain values", "bad input"),
    ("calls input(", "calls input()"),
    ("top-level function", "not one function"),
    ("positional parameter", "no parameter"),
    ("longer than", "program too long"),
    ("valid distinct inputs", "too few valid inputs"),
    ("input blocks, need", "too few input blocks"),  # code_f under tasks.code_f_rule=azr
    ("execution failed", "runtime error"),
    ("failed", "runtime error"),
)


def envelope_reason(text: str) -> str:
    """Which part of ``<think>…</think><answer>…</answer>`` is missing (the think tag counts as pre-filled)."""
    from populora_verl.tasks.parsing import normalise_response

    try:
        t = normalise_response(text, True)
    except ValueError:
        return "envelope: not text"
    close = t.find("</think>")
    if close < 0:
        return "envelope: no </think>"
    after = t[close:]
    if "<answer>" not in after:
        return "envelope: no <answer>"
    if "</answer>" not in after[after.find("<answer>") :]:
        return "envelope: <answer> not closed"
    return "envelope: malformed"


def failure_reason(text: str, status: str, reason: str) -> str | None:
    """A short category for a proposal that failed (None when valid)."""
    if status == "valid":
        return None
    low = (reason or "").lower()
    if status == "format_error" and ("<think>" in low or "<answer>" in low or "envelope" in low or not low):
        return envelope_reason(text)
    for needle, cat in _REASON_RULES:
        if needle in low:
            return cat
    return f"other: {reason.strip()[:60]}" if reason else f"other: {status}"


# --- one setting -----------------------------------------------------------------------------------------------


@dataclass
class TypeReport:
    task_type: str
    proposals: int = 0
    valid: int = 0
    format_error: int = 0
    invalid: int = 0
    hit_cap: int = 0
    mean_tokens: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    solved_valid: int = 0
    answers_valid: int = 0
    solved_seed: int = 0
    answers_seed: int = 0
    student_format_error: int = 0
    student_answers: int = 0

    @property
    def valid_rate(self) -> float:
        return self.valid / self.proposals if self.proposals else 0.0


def build_config(template: str, seed_file: str | None, overrides: Mapping[str, Any] | None = None) -> Any:
    """The ``populora`` config the probe validates with: defaults, ``overrides`` (dotted keys under populora),
    the template and the seed file."""
    from populora_verl.config import load_config

    data: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        parts = key.split(".")
        if parts[0] == "populora":
            parts = parts[1:]
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    data.setdefault("tasks", {})["prompt_template"] = "azr" if template == "azr-in-chat" else template
    if seed_file:
        data.setdefault("buffer", {})["seed_file"] = seed_file
    return load_config(data)


def _parallel(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def run_setting(
    engine: ProbeEngine,
    setting: Setting,
    *,
    types: Sequence[str],
    proposals: int,
    student_n: int,
    seed_file: str | None,
    executor: Any,
    seed: int = 0,
    top_p: float = 1.0,
    max_prompt_tokens: int = 4096,
    overrides: Mapping[str, Any] | None = None,
    workers: int = 8,
    progress: Any = None,
) -> dict[str, Any]:
    """Proposals, their validation and the student answers for one setting; a JSON-ready dict."""
    from populora_verl.step.task_env import TaskEnv
    from populora_verl.tasks import validate_proposal

    if setting.prompt_file:
        overrides = {**(overrides or {}), "tasks.prompt_file": setting.prompt_file}
    cfg = build_config(setting.template, seed_file, overrides)
    env = TaskEnv(cfg, executor=executor)
    rng = random.Random(seed)
    tok = engine.tokenizer

    def _gen(prompts: list[Any], phase: int) -> tuple[list[Generation], float]:
        t0 = time.perf_counter()
        ids = [encode_prompt(tok, p, setting.template, max_prompt_tokens) for p in prompts]
        gens = (
            engine.generate(
                ids,
                max_tokens=setting.max_tokens,
                temperature=setting.temperature,
                top_p=top_p,
                seed=seed * 1000 + phase,
            )
            if ids
            else []
        )
        return gens, time.perf_counter() - t0

    # 1. proposals, every type in one batch
    requests = [(tt, *env.proposer_request(tt, rng)) for tt in types for _ in range(proposals)]
    if progress is not None:
        progress.set_postfix_str(f"{setting.label}: proposals")
    gens, gen_s = _gen([p for _, p, _ in requests], 0)

    def _validate(i: int) -> Any:
        tt, _, meta = requests[i]
        return validate_proposal(
            gens[i].text,
            tt,
            env.executor,
            cfg,
            program=meta.get("program"),
            teacher="probe",
            step=0,
            think_prefilled=env.think_prefilled,
        )

    if progress is not None:
        progress.set_postfix_str(f"{setting.label}: validation")
    t0 = time.perf_counter()
    results = _parallel(_validate, list(range(len(requests))), workers)
    validate_s = time.perf_counter() - t0

    reports = {tt: TypeReport(tt) for tt in types}
    valid_tasks: list[Any] = []
    for (tt, _, _), g, res in zip(requests, gens, results):
        r = reports[tt]
        r.proposals += 1
        r.hit_cap += int(g.hit_cap)
        r.mean_tokens += g.tokens
        r.valid += int(res.status == "valid")
        r.format_error += int(res.status == "format_error")
        r.invalid += int(res.status == "invalid")
        why = failure_reason(g.text, res.status, getattr(res, "reason", ""))
        if why is None:
            valid_tasks.append(res.task)
            continue
        r.reasons[why] = r.reasons.get(why, 0) + 1
        ex = r.examples.setdefault(why, [])
        if len(ex) < EXAMPLES_PER_REASON:
            ex.append(g.text[:EXAMPLE_CHARS])
    for r in reports.values():
        r.mean_tokens = r.mean_tokens / r.proposals if r.proposals else 0.0
        r.reasons = dict(Counter(r.reasons).most_common())

    # 2. students: the valid proposals and the seed tasks, student_n answers each
    seed_tasks = [t for tt in types for t in env.buffers[tt]]
    jobs = [(t, "valid") for t in valid_tasks] + [(t, "seed") for t in seed_tasks]
    jobs = [j for j in jobs for _ in range(student_n)]
    if progress is not None:
        progress.set_postfix_str(f"{setting.label}: students")
    sgens, student_gen_s = _gen([env.solver_request(t) for t, _ in jobs], 1)
    t0 = time.perf_counter()
    chunk = max(1, len(jobs) // max(1, workers))
    pieces = [list(zip(jobs[i : i + chunk], sgens[i : i + chunk])) for i in range(0, len(jobs), chunk)]
    scored = [
        s
        for part in _parallel(lambda part: env.score_many([(t, g.text) for (t, _), g in part]), pieces, workers)
        for s in part
    ]
    score_s = time.perf_counter() - t0
    from populora_verl.tasks import extract_answer

    for ((task, kind), g), (_, correct, _) in zip(zip(jobs, sgens), scored):
        r = reports[task.type]
        r.student_answers += 1
        try:
            extract_answer(g.text, env.think_prefilled)
        except ValueError:
            r.student_format_error += 1
        if kind == "valid":
            r.answers_valid += 1
            r.solved_valid += int(correct)
        else:
            r.answers_seed += 1
            r.solved_seed += int(correct)
    return {
        "setting": asdict(setting),
        "label": setting.label,
        "types": {tt: {**asdict(r), "valid_rate": r.valid_rate} for tt, r in reports.items()},
        "seed_tasks": len(seed_tasks),
        "student_n": student_n,
        "seconds": {
            "propose_generate": round(gen_s, 2),
            "validate": round(validate_s, 2),
            "student_generate": round(student_gen_s, 2),
            "score": round(score_s, 2),
        },
    }


# --- output ----------------------------------------------------------------------------------------------------


def _frac(k: int, n: int) -> str:
    return f"{k}/{n} ({100.0 * k / n:.0f}%)" if n else "–"


def render_table(results: Iterable[Mapping[str, Any]], top_reasons: int = 3) -> str:
    """One markdown row per (setting, task type)."""
    lines = [
        "| model | template | tokens | T | type | valid | format err. | invalid | top failure reasons | "
        "hit length cap | mean tokens | solved (valid tasks) | solved (seed tasks) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        s = res["setting"]
        words = f" ({Path(s['prompt_file']).stem})" if s.get("prompt_file") else ""
        for tt, r in res["types"].items():
            reasons = ", ".join(f"{k} {v}" for k, v in list(r["reasons"].items())[:top_reasons]) or "–"
            lines.append(
                f"| {Path(s['model']).name} | {s['template']}{words} | {s['max_tokens']} | {s['temperature']:g} "
                f"| {tt} | "
                f"{_frac(r['valid'], r['proposals'])} | {r['format_error']} | {r['invalid']} | {reasons} | "
                f"{r['hit_cap']} | {r['mean_tokens']:.0f} | {_frac(r['solved_valid'], r['answers_valid'])} | "
                f"{_frac(r['solved_seed'], r['answers_seed'])} |"
            )
    return "\n".join(lines) + "\n"


# --- command line ----------------------------------------------------------------------------------------------


def _parse_set(items: Sequence[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            from populora_verl.cli_errors import UsageError

            raise UsageError(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _training_default_template() -> str:
    from populora_verl.config import TasksConfig

    return TasksConfig().prompt_template


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m populora_verl.bench.validity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", required=True, help="HF model folder(s); one engine per model")
    ap.add_argument(
        "--templates",
        nargs="+",
        default=[_training_default_template()],
        choices=TEMPLATES,
        help="azr / chat: what training sends for populora.tasks.prompt_template=azr / chat (default: "
        "what training sends by default); azr-in-chat: the azr text wrapped in one chat turn, for "
        "comparison only",
    )
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024], help="max answer tokens")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[1.0])
    ap.add_argument(
        "--prompt-files",
        nargs="+",
        default=["default"],
        metavar="FILE",
        help="populora.tasks.prompt_file per setting; 'default' is our own wording",
    )
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--types", nargs="+", default=["code_o", "code_i", "code_f"])
    ap.add_argument("--proposals", type=int, default=64, help="proposals per task type and setting")
    ap.add_argument("--student-n", type=int, default=4, help="student answers per valid task and per seed task")
    ap.add_argument(
        "--seed-file",
        default=DEFAULT_SEED_FILE,
        help="JSONL seed tasks (references and seed solve rate); 'none' = AZR's identity seeds",
    )
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="populora config overrides, e.g. populora.tasks.num_references=2",
    )
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--max-prompt-tokens", type=int, default=4096)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM: skip CUDA graphs (faster start)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-size", type=int, default=16, help="hf engine batch size")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="executor threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="validity-out")
    return ap


def _build_engine(args: argparse.Namespace, model: str) -> ProbeEngine:
    if args.engine == "hf":
        return HFProbeEngine(model, batch_size=args.batch_size, dtype=args.dtype)
    return VLLMProbeEngine(
        model,
        max_model_len=args.max_prompt_tokens + max(args.lengths),
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from populora_verl.cli_errors import run_cli

    return run_cli("populora_verl.bench.validity", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    from populora_verl.cli_errors import UsageError, check_model_path, check_output_dir

    seed_file = None if str(args.seed_file).lower() == "none" else args.seed_file
    overrides = _parse_set(args.set)
    cfg = build_config(args.templates[0], seed_file, overrides)  # fail on a bad key before any model loads
    if seed_file and not Path(seed_file).is_file():
        raise UsageError(f"--seed-file {seed_file}: no such file")
    prompt_files = [None if f.lower() == "default" else str(Path(f).resolve()) for f in args.prompt_files]
    for f in prompt_files:
        if f is not None:
            build_config(args.templates[0], seed_file, {**overrides, "tasks.prompt_file": f})
    for model in args.model:  # every model, not only the first: the second would fail after the first's settings
        check_model_path(model, "--model", hub=False)
    out = check_output_dir(args.out, "--out")
    settings = [
        Setting(m, t, n, temp, f)
        for m in args.model
        for t in args.templates
        for f in prompt_files
        for n in args.lengths
        for temp in args.temperatures
    ]
    results: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        _run_all(args, settings, seed_file, overrides, cfg, results)
    except _ProbeError as e:
        raise UsageError(str(e)) from None
    table = render_table(results)
    header = (
        f"# Validity probe\n\nengine {args.engine}, {args.proposals} proposals per type, {args.student_n} "
        f"student answers per task, seed file {seed_file or 'AZR identity seeds'}, "
        f"{time.perf_counter() - t_start:.0f} s in all.\n\n"
    )
    (out / "results.md").write_text(header + table, encoding="utf-8")
    print(table)
    print(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    return 0


class _ProbeError(Exception):
    """A setting the probe cannot run; reported in one line."""


def _run_all(
    args: argparse.Namespace,
    settings: Sequence[Setting],
    seed_file: str | None,
    overrides: Mapping[str, Any],
    cfg: Any,
    results: list[dict[str, Any]],
) -> None:
    from tqdm.auto import tqdm

    from populora_verl.executor import Executor

    out = Path(args.out)
    with (
        Executor.from_config(cfg.executor, max_workers=args.workers) as executor,
        tqdm(total=len(settings), desc="validity", unit="setting") as bar,
    ):
        for model in args.model:
            t0 = time.perf_counter()
            bar.set_postfix_str(f"loading {Path(model).name}")
            try:
                engine = _build_engine(args, model)
            except (OSError, ValueError) as e:  # no weights / no tokenizer / unsupported architecture
                raise _ProbeError(
                    f"--model {model}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                ) from None
            load_s = time.perf_counter() - t0
            wrapped = [t for t in args.templates if t != "azr"]
            if wrapped and not getattr(engine.tokenizer, "chat_template", None):
                raise _ProbeError(
                    f"{model}: the tokenizer has no chat template, needed by --templates {' '.join(wrapped)} (use azr)"
                )
            for s in (s for s in settings if s.model == model):
                res = run_setting(
                    engine,
                    s,
                    types=args.types,
                    proposals=args.proposals,
                    student_n=args.student_n,
                    seed_file=seed_file,
                    executor=executor,
                    seed=args.seed,
                    top_p=args.top_p,
                    max_prompt_tokens=args.max_prompt_tokens,
                    overrides=overrides,
                    workers=args.workers,
                    progress=bar,
                )
                res["seconds"]["engine_load"] = round(load_s, 2)
                results.append(res)
                out.mkdir(parents=True, exist_ok=True)  # only once there is a result: a failed start leaves nothing
                (out / "results.json").write_text(
                    json.dumps({"args": vars(args), "results": results}, indent=1), encoding="utf-8"
                )
                bar.update(1)
            # Free this model's engine before the next one is built (vLLM's engine core exits when collected).
            del engine
            import gc

            gc.collect()


if __name__ == "__main__":
    sys.exit(main())
