"""What the plugin adds to ``import verl``, which every process of a verl run pays (CPU only, no GPU).

    python -m populora_verl.bench.plugin_import [--rounds 7] [--timeout-s 300]

verl imports the plugin in every process at ``import verl`` (the task runner, the FSDP workers, the vLLM server,
the load balancer, the agent-loop and reward workers). Each round runs each arm once, in a fresh interpreter, in an
order that alternates between rounds:

* ``verl``: ``import verl`` with ``VERL_USE_EXTERNAL_PLUGINS=none`` (verl alone);
* ``plugin``: ``import verl`` with the plugin (``VERL_USE_EXTERNAL_MODULES=populora_verl.plugin``; entry-point
  discovery stays off in every arm, so another installed plugin counts in none);
* ``task_runner``: the same, then what the task runner does to find its trainer: ``from verl.trainer.ppo.v1 import
  get_trainer_cls; get_trainer_cls("populora")``.

Each child times its imports itself (interpreter start-up excluded; the parent's wall time per process is shown
too) and counts ``sys.modules``. Prints the median and min-max per arm, the plugin's overhead (``plugin`` - ``verl``)
in seconds and modules, the CPU count and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from populora_verl.bench import child

__all__ = ["ARMS", "PLUGIN", "child_code", "child_env", "run_child", "summarise", "table", "main"]

PLUGIN = "populora_verl.plugin"
_RESULT = "PLUGIN_IMPORT "

#: arm -> (what it measures, code run after ``import verl``, whether the plugin is loaded)
ARMS: dict[str, tuple[str, str, bool]] = {
    "verl": ("`import verl`, no plugin", "", False),
    "plugin": ("`import verl` with the plugin", "", True),
    "task_runner": (
        '+ `get_trainer_cls("populora")`',
        'from verl.trainer.ppo.v1 import get_trainer_cls\nget_trainer_cls("populora")\n',
        True,
    ),
}


def child_code(arm: str) -> str:
    """The child's program: the arm's imports timed from inside, then one result line."""
    return (
        "import sys, time\n"
        "t0 = time.perf_counter()\n"
        "import verl\n"
        f"{ARMS[arm][1]}"
        "t1 = time.perf_counter()\n"
        "n = len(sys.modules)\n"
        "import json\n"
        f"print({_RESULT!r} + json.dumps({{'import_s': t1 - t0, 'modules': n, 'plugin': {PLUGIN!r} in sys.modules}}),"
        " flush=True)\n"
    )


def child_env(arm: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The arm's environment: entry-point plugins off, the plugin loaded by module where the arm has it."""
    env = dict(os.environ if base is None else base)
    env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    if ARMS[arm][2]:
        env["VERL_USE_EXTERNAL_MODULES"] = PLUGIN
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return env


def run_child(arm: str, timeout_s: float) -> dict[str, float]:
    """One fresh interpreter of ``arm``: ``import_s`` (timed inside), ``process_s`` (its wall time) and ``modules``."""
    start = time.perf_counter()
    out = child.run(
        [sys.executable, "-c", child_code(arm)],
        marker=_RESULT,
        what=f"import ({arm})",
        env=child_env(arm),
        timeout=timeout_s,
    )
    process_s = time.perf_counter() - start
    if out["plugin"] != ARMS[arm][2]:
        raise RuntimeError(f"arm {arm}: {PLUGIN} {'not ' if ARMS[arm][2] else ''}imported by `import verl`")
    return {"import_s": float(out["import_s"]), "process_s": process_s, "modules": float(out["modules"])}


def summarise(samples: dict[str, list[dict[str, float]]]) -> list[dict[str, float | str | int]]:
    """One row per arm (in :data:`ARMS` order): median and range of ``import_s``, median ``process_s`` and modules."""
    rows: list[dict[str, float | str | int]] = []
    for arm in ARMS:
        ts = samples.get(arm) or []
        if not ts:
            continue
        imports = [t["import_s"] for t in ts]
        rows.append(
            {
                "arm": arm,
                "n": len(ts),
                "median_s": statistics.median(imports),
                "min_s": min(imports),
                "max_s": max(imports),
                "process_s": statistics.median(t["process_s"] for t in ts),
                "modules": int(statistics.median(t["modules"] for t in ts)),
            }
        )
    return rows


def table(rows: list[dict[str, float | str | int]]) -> str:
    """The markdown table of :func:`summarise`'s rows, and the plugin's overhead when both of its arms ran."""
    lines = [
        "| arm | what | runs | median s | min-max s | process s | modules |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {ARMS[str(r['arm'])][0]} | {r['n']} | {r['median_s']:.2f} | "
            f"{r['min_s']:.2f}-{r['max_s']:.2f} | {r['process_s']:.2f} | {r['modules']} |"
        )
    by_arm = {r["arm"]: r for r in rows}
    if "verl" in by_arm and "plugin" in by_arm:
        base, plug = by_arm["verl"], by_arm["plugin"]
        lines.append("")
        lines.append(
            f"plugin overhead (plugin - verl): {float(plug['median_s']) - float(base['median_s']):+.2f} s median, "
            f"{int(plug['modules']) - int(base['modules']):+d} modules"
        )
    return "\n".join(lines)


def _cpus() -> str:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return f"{os.cpu_count()} CPUs" + (f" ({affinity} usable)" if affinity is not None else "")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m populora_verl.bench.plugin_import", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rounds", type=int, default=7, help="rounds of one fresh interpreter per arm")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per interpreter")
    return ap


def main(argv: Sequence[str] | None = None, measure: Callable[[str, float], dict[str, float]] = run_child) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    samples, (load_before, load_after) = child.rounds(
        list(ARMS),
        args.rounds,
        lambda arm: measure(arm, args.timeout_s),
        lambda arm, t: f"{arm}: {t['import_s']:.2f} s, {int(t['modules'])} modules",
    )
    print(
        f"\n{_cpus()}; load average {load_before:.2f} before, {load_after:.2f} after; Python "
        f"{sys.version.split()[0]}; {args.rounds} rounds, order alternating; seconds of the imports, timed inside "
        "each fresh interpreter (process s: its whole run, start-up and exit included)\n"
    )
    print(table(summarise(samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
