"""``python -m populora_verl.local``: a PopuLoRA run on CPU (embedded tiny model by default; no download).

Configuration, lowest to highest precedence: the driver's defaults (2T+2S, short generations), ``--config YAML``
(``populora:`` and ``local:`` sections; on ``--resume`` the run's saved ``config.yaml`` comes first), the flags, and
``key=value`` overrides of ``populora.*`` / ``local.*`` keys. Any invalid value, and any unusable ``--run-dir``,
``--model``, ``--gguf`` or ``--config``, stops start-up before a model loads with one ``populora-local: error:``
line naming the key or flag (exit status 2), and leaves nothing behind.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from populora_verl.config import ConfigError, PopuLoRAConfig, load_config
from populora_verl.local.config import TINY_LOCAL_DEFAULTS, TINY_POPULORA_DEFAULTS, LocalConfig, load_local_config

__all__ = ["main", "build_configs", "parse_args"]

# Real models on CPU: keep generations short unless told otherwise.
REAL_MODEL_DEFAULTS = {"rollout": {"max_new_tokens": 256}}


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        node = nxt
    node[parts[-1]] = value


def _parse_override(item: str) -> tuple[str, Any]:
    import yaml

    if "=" not in item:
        raise ConfigError(f"{item}: overrides are key=value (e.g. populora.pbt.interval_steps=3)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not (key.startswith("populora.") or key.startswith("local.")):
        raise ConfigError(f"{key}: only populora.* and local.* keys can be overridden")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="populora-local",
        description="PopuLoRA on CPU: a population of LoRA adapters in AZR self-play "
        "(also `python -m populora_verl.local`).",
    )
    p.add_argument("--model", help="local HF model folder (default: an embedded tiny random model)")
    p.add_argument("--gguf", help="a GGUF model file (transformers + gguf)")
    p.add_argument("--steps", type=int, help="total steps (local.steps)")
    p.add_argument("--teachers", type=int, help="populora.population.num_teachers")
    p.add_argument("--students", type=int, help="populora.population.num_students")
    p.add_argument("--single-agent", action="store_true", help="the AZR baseline: one adapter in both roles")
    p.add_argument("--run-dir", default="runs/local", help="run directory (default: runs/local)")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument("--seed", type=int, help="populora.population.seed")
    p.add_argument("--config", help="YAML with populora: and/or local: sections")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar (the per-step lines stay)")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    p.add_argument("overrides", nargs="*", help="populora.<section>.<key>=value or local.<key>=value")
    return p.parse_intermixed_args(argv)  # overrides may come before or after the flags


def build_configs(args: argparse.Namespace) -> tuple[PopuLoRAConfig, LocalConfig]:
    """Layer defaults, YAML, flags and overrides; validate. Raises :class:`ConfigError` naming the bad key."""
    import yaml

    tree: dict[str, Any] = {"populora": copy.deepcopy(TINY_POPULORA_DEFAULTS), "local": {}}
    if args.model or args.gguf:
        tree["populora"] = _merge(tree["populora"], REAL_MODEL_DEFAULTS)
    else:
        tree["local"] = copy.deepcopy(TINY_LOCAL_DEFAULTS)
    files = []
    saved = Path(args.run_dir) / "config.yaml"
    if args.resume and saved.is_file():
        files.append((saved, "--resume: the run's saved config"))  # not the user's --config: say which file
    if args.config:
        files.append((Path(args.config), "--config"))
    for path, what in files:
        if not path.is_file():
            raise ConfigError(f"{what}: no such file {path}")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError(f"{what}: {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from e
        except UnicodeDecodeError:
            raise ConfigError(f"{what}: {path} is not a UTF-8 text file") from None
        except OSError as e:
            raise ConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"{what}: {path} must hold a mapping with populora: / local: sections")
        unknown = set(data) - {"populora", "local"}
        if unknown:
            raise ConfigError(f"{sorted(unknown)[0]}: unknown top-level section in {path} (known: populora, local)")
        tree = _merge(tree, data)
    flags = {
        "local.steps": args.steps,
        "populora.population.num_teachers": args.teachers,
        "populora.population.num_students": args.students,
        "populora.population.seed": args.seed,
        "populora.population.mode": "single_agent" if args.single_agent else None,
    }
    for key, value in flags.items():
        if value is not None:
            _set_dotted(tree, key, value)
    if args.quiet:
        _set_dotted(tree, "local.progress", False)
    for item in args.overrides:
        key, value = _parse_override(item)
        _set_dotted(tree, key, value)
    cfg = load_config(tree.get("populora") or {})
    local = load_local_config(tree.get("local") or {})
    return cfg, local


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from populora_verl.cli_errors import run_cli

    return run_cli(
        "populora-local",
        lambda: _run(args),
        debug=args.debug,
        on_interrupt=lambda: interrupted_message(args.run_dir, resume_cmd(args)),
    )


def resume_cmd(args: argparse.Namespace) -> str:
    import shlex

    # The model is a flag, not part of the saved config: the resumed run must be given the same one. So is a
    # --steps given on a resume (the saved config keeps the first start's): without it, the run would end at once.
    model = (
        f" --model {shlex.quote(args.model)}"
        if args.model
        else f" --gguf {shlex.quote(args.gguf)}"
        if args.gguf
        else ""
    )
    steps = f" --steps {args.steps}" if args.steps is not None else ""
    return f"python -m populora_verl.local --run-dir {shlex.quote(str(args.run_dir))}{model}{steps} --resume"


def interrupted_message(run_dir: str | Path, resume: str) -> str:
    from populora_verl.checkpoint import latest_checkpoint

    ck = latest_checkpoint(run_dir)
    if ck is None:
        return "interrupted before the first checkpoint was complete: nothing to resume, start again"
    return f"interrupted; last complete checkpoint: {ck}; continue with: {resume}"


def check_paths(args: argparse.Namespace) -> None:
    """Every path flag, before any model loads or anything is written; :class:`UsageError` names the flag."""
    from populora_verl.cli_errors import UsageError, check_model_path, check_output_dir, check_run_dir

    if args.model and args.gguf:
        raise UsageError("--model and --gguf are exclusive")
    if args.resume and not Path(args.run_dir).exists() and not Path(args.run_dir).is_symlink():
        raise UsageError(f"--resume: no run directory {args.run_dir}; drop --resume to start a new run there")
    check_run_dir(args.run_dir, "--run-dir", must_exist=args.resume)
    if args.resume:  # a resumed run writes into it: its lock, metrics and checkpoints
        check_output_dir(args.run_dir, "--run-dir")
    if args.model:
        check_model_path(args.model, "--model", hub=False)  # the CPU driver loads local folders only
    if args.gguf and not Path(args.gguf).is_file():
        raise UsageError(f"--gguf {args.gguf}: no such file")
    if args.config and not Path(args.config).is_file():
        raise UsageError(f"--config {args.config}: no such file")
    if args.single_agent:  # one adapter in both roles: a count would be ignored, yet saved with the run
        for flag, value in (("--teachers", args.teachers), ("--students", args.students)):
            if value is not None:
                raise UsageError(f"{flag}: --single-agent is one adapter in both roles; drop {flag} or --single-agent")


def _default_population(args: argparse.Namespace) -> bool:
    """Whether the population's sizes and PBT roles are the driver's own defaults (2T+2S, both roles evolve)."""
    keys = ("populora.population.", "populora.pbt.roles", "populora.pbt.cull_fraction")
    return (
        args.teachers is None
        and args.students is None
        and not args.config
        and not args.resume
        and not any(o.split("=", 1)[0].strip().startswith(keys) for o in args.overrides)
    )


class _DefaultPopulationNote(logging.Filter):
    """Drops the start-up warning that a 2-member role collapses to one lineage when 2T+2S is the driver's own
    default: replacing the weaker member by a child of the stronger is what the demo is there to show, and a
    warning about a setting the user never chose reads as a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sub-population has 2 members" not in record.getMessage()


def _run(args: argparse.Namespace) -> int:
    from populora_verl.cli_errors import UsageError, one_line

    check_paths(args)
    cfg, local = build_configs(args)
    from populora_verl.checks import check_population_inputs

    check_population_inputs(cfg)  # operator names and the seed file, before the model loads
    # Our own notes at INFO; other libraries only when they warn (matplotlib's first-run font cache note is noise).
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("populora_verl").setLevel(logging.INFO)
    from populora_verl.checkpoint import CheckpointError
    from populora_verl.local.driver import LocalDriver
    from populora_verl.runlock import RunDirInUse

    pbt_log, note = logging.getLogger("populora_verl.evolution.pbt"), _DefaultPopulationNote()
    if _default_population(args):
        pbt_log.addFilter(note)  # only while the driver starts: the warning is a start-up check
    try:
        driver = LocalDriver(cfg, local, args.run_dir, model_path=args.model, gguf=args.gguf, resume=args.resume)
    except (FileNotFoundError, FileExistsError, CheckpointError, RunDirInUse) as e:
        if args.debug:
            raise
        raise UsageError(one_line(e)) from None  # the run never started: bad input, exit status 2
    finally:
        pbt_log.removeFilter(note)
    try:
        pop = driver.population
        what = (
            "single agent (AZR baseline)"
            if cfg.population.mode == "single_agent"
            else f"{len(pop.teachers())} teachers + {len(pop.students())} students"
        )
        print(f"populora local: {what}, steps {driver.start_step + 1}..{local.steps}, run dir {driver.run_dir}")
        driver.run()
    finally:
        driver.close()
    _print_summary(driver, tiny=not (args.model or args.gguf))
    return 0


def _print_summary(driver: Any, tiny: bool = False) -> None:
    pop = driver.population
    last = driver.history[-1] if driver.history else {}
    print(f"\nfinished step {pop.step}; population:")
    print(f"  {'id':<5} {'role':<8} {'slot':>4} {'mu':>7} {'sigma':>6} {'mu-3s':>7}  parents (operator, born)")
    for m in pop.members:
        r = pop.ratings[m.id]
        origin = f"{'+'.join(m.parents)} ({m.operator}, step {m.birth_step})" if m.parents else "founder"
        print(f"  {m.id:<5} {m.role:<8} {m.slot:>4} {r.mu:7.2f} {r.sigma:6.2f} {r.mu - 3 * r.sigma:7.2f}  {origin}")
    dead = [m for m in pop.lineage if not m.alive]
    if dead:
        print("  replaced: " + ", ".join(f"{m.id} (step {m.death_step})" for m in dead))
    if last:
        print(
            f"last step: validity {last.get('populora/validity/mean', 0):.2f}, student accuracy "
            f"{last.get('populora/student/accuracy', 0):.2f}, coverage {last.get('populora/coverage/fraction', 0):.2f}"
        )
    from populora_verl.local.progress import TINY_MODEL_NOTE, files_written

    print("files written:")
    print("\n".join(files_written(driver.run_dir)))
    if tiny:
        import textwrap

        print(textwrap.fill(TINY_MODEL_NOTE, width=110))


if __name__ == "__main__":
    sys.exit(main())
