"""Executor benchmark: validations/second of our sandbox vs an AZR-style pool vs a fresh ``python -c``.

    python -m populora_verl.bench.executor [--n 600] [--timeout 1.0] [--workers N] [--rounds 3] [--out FILE.md]

Three systems get the same programs, the same timeout and the same number of parallel slots, and do the same
work per program (run ``f(<inputs>)`` twice, compare, ``repr``):
- ``ours``: :class:`~populora_verl.executor.Executor` with every protection this host allows (printed);
- ``azr_pool``: :mod:`populora_verl.bench.azr_pool`, a pebble process pool ``exec``-ing programs with no
  isolation, as AZR's executor does (``pip install -e .[bench]`` for pebble);
- ``python_c``: a fresh ``python -c`` subprocess per program (no isolation, an address-space rlimit only).
Programs that would harm the host when run unsandboxed (fork bomb, killing the parent) are replaced by an
equally cheap failing program on the two unsandboxed sides only. Two mixes: the bench mix below, and its
ordinary programs only. Rounds are interleaved (systems in rotating order); the table gives the median and the
min..max over rounds, with the machine and the load average seen during the run.

Mix (fractions of ``--n``): ~97% ordinary AZR-style programs (string/list/dict manipulation, small loops,
recursion), 1% slow CPU-bound ones (0.2-0.6 s, near a 1 s limit), 2% hostile (infinite loop, blocking sleep,
memory bomb, fork bomb, huge output, banned imports, os._exit, segfault, nondeterminism, killing the parent).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from populora_verl.executor import Executor

__all__ = ["Item", "make_mix", "main"]


@dataclass(frozen=True)
class Item:
    kind: str  # normal | slow | hostile
    program: str
    inputs: str
    host_unsafe: bool = False


_NORMAL = [
    ("def f(s):\n    return ''.join(c for c in s if c not in 'aeiou')[::-1]", lambda r: repr(_word(r))),
    (
        "def f(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if c.isalpha() else c for c in s)",
        lambda r: f"{_word(r)!r}, {r.randint(1, 25)}",
    ),
    (
        "def f(s):\n    best = ''\n    for i in range(len(s)):\n        for j in range(i + 1, len(s) + 1):\n"
        "            t = s[i:j]\n            if t == t[::-1] and len(t) > len(best):\n                best = t\n"
        "    return best",
        lambda r: repr(_word(r, 12)),
    ),
    (
        "def f(xs):\n    out, acc = [], 0\n    for x in xs:\n        acc += x\n        out.append(acc)\n    return out",
        lambda r: repr([r.randint(-9, 9) for _ in range(r.randint(3, 12))]),
    ),
    (
        "def f(xs, k):\n    return max(sum(xs[i:i + k]) for i in range(len(xs) - k + 1))",
        lambda r: f"{[r.randint(-9, 9) for _ in range(10)]!r}, {r.randint(1, 5)}",
    ),
    (
        "def f(xs):\n    return sorted(set(xs), key=lambda x: (xs.count(x), -x), reverse=True)",
        lambda r: repr([r.randint(0, 5) for _ in range(12)]),
    ),
    (
        "def f(words):\n    d = {}\n    for w in words:\n        d[len(w)] = d.get(len(w), []) + [w]\n"
        "    return {k: sorted(v) for k, v in sorted(d.items())}",
        lambda r: repr([_word(r) for _ in range(6)]),
    ),
    (
        "from collections import Counter\ndef f(s):\n    c = Counter(s)\n"
        "    return sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:3]",
        lambda r: repr(_word(r, 20)),
    ),
    (
        "def f(d):\n    return {v: k for k, v in d.items() if isinstance(v, int) and v % 2 == 0}",
        lambda r: repr({_word(r, 3): r.randint(0, 9) for _ in range(5)}),
    ),
    (
        "def f(n):\n    steps = 0\n    while n != 1:\n        n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
        "        steps += 1\n    return steps",
        lambda r: str(r.randint(2, 10**5)),
    ),
    ("def f(n):\n    return sum(i * i for i in range(n) if i % 3 == 0)", lambda r: str(r.randint(10, 5000))),
    (
        "def f(n, memo={}):\n    if n < 2:\n        return n\n    if n not in memo:\n"
        "        memo[n] = f(n - 1) + f(n - 2)\n    return memo[n]",
        lambda r: str(r.randint(5, 90)),
    ),
    (
        "def f(xs):\n    if len(xs) <= 1:\n        return xs\n    p = xs[0]\n"
        "    return f([x for x in xs[1:] if x < p]) + [p] + f([x for x in xs[1:] if x >= p])",
        lambda r: repr([r.randint(0, 99) for _ in range(15)]),
    ),
    (
        "from itertools import permutations\ndef f(s):\n    return sorted({''.join(p) for p in permutations(s)})[:5]",
        lambda r: repr(_word(r, 5)),
    ),
    (
        "def f(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
        lambda r: f"{r.randint(1, 10**6)}, {r.randint(1, 10**6)}",
    ),
    (
        "def f(m):\n    return [list(row) for row in zip(*m)]",
        lambda r: repr([[r.randint(0, 9) for _ in range(3)] for _ in range(3)]),
    ),
]
_SLOW = "def f(n):\n    s = 0\n    for i in range(n):\n        s = (s + i * i) % 1000003\n    return s"
_HOSTILE = [
    ("def f(x):\n    while True:\n        x += 1", False),
    ("def f(x):\n    import select\n    select.select([], [], [], 3600)", False),
    ("def f(x):\n    a = []\n    while True:\n        a.append(bytearray(10**7))", False),
    ("def f(x):\n    import os\n    while True:\n        os.fork()", True),
    ("def f(x):\n    return 'a' * (20 * 10**6)", False),
    ("import random\ndef f(x):\n    return random.random()", False),
    ("def f(x):\n    return __import__('subprocess').run(['id'])", False),
    ("def f(x):\n    import os\n    os._exit(1)", False),
    ("def f(x):\n    import ctypes\n    return ctypes.string_at(0)", False),
    ("def f(x):\n    return id(object())", False),
    ("c = [0]\ndef f(x):\n    c[0] += 1\n    return c[0]", False),
    ("def f(x):\n    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n    return 1", True),
]
_SURROGATE = "def f(x):\n    raise RuntimeError('host-unsafe program skipped on the unsandboxed baseline')"


def _word(r: random.Random, n: int | None = None) -> str:
    return "".join(r.choice("abcdeilmnorstu") for _ in range(n or r.randint(3, 10)))


def make_mix(n: int, seed: int = 0, slow_frac: float = 0.01, hostile_frac: float = 0.02) -> list[Item]:
    r = random.Random(seed)
    n_slow = max(1, round(n * slow_frac))
    n_hostile = max(len(_HOSTILE), round(n * hostile_frac))
    items = [
        Item("hostile", *_HOSTILE[i % len(_HOSTILE)][:1], "1", _HOSTILE[i % len(_HOSTILE)][1]) for i in range(n_hostile)
    ]
    # 0.2-0.6 s for both determinism calls together (~0.2 us per iteration on these cores)
    items += [Item("slow", _SLOW, str(r.randint(5 * 10**5, 15 * 10**5))) for _ in range(n_slow)]
    for _ in range(n - len(items)):
        prog, gen = r.choice(_NORMAL)
        items.append(Item("normal", prog, gen(r)))
    r.shuffle(items)
    return items


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


class _Ours:
    name = "ours"

    def __init__(self, timeout: float, workers: int) -> None:
        self.ex = Executor(timeout_s=timeout, memory_mb=512, max_workers=workers)

    def run_many(self, items: list[Item]) -> list[tuple[bool, str | None]]:
        return [(r.ok, r.output) for r in self.ex.run_many([(it.program, it.inputs) for it in items])]

    def close(self) -> None:
        self.ex.close()


class _AzrPool:
    name = "azr_pool"

    def __init__(self, timeout: float, workers: int) -> None:
        from populora_verl.bench.azr_pool import AzrStylePool

        self.pool = AzrStylePool(workers, timeout)

    def run_many(self, items: list[Item]) -> list[tuple[bool, str | None]]:
        return self.pool.run_many([(_SURROGATE if it.host_unsafe else it.program, it.inputs) for it in items])

    def close(self) -> None:
        self.pool.close()


class _PythonC:
    name = "python_c"

    def __init__(self, timeout: float, workers: int) -> None:
        self.timeout, self.pool = timeout, ThreadPoolExecutor(workers)

    def run_many(self, items: list[Item]) -> list[tuple[bool, str | None]]:
        return list(self.pool.map(lambda it: _baseline_one(it, self.timeout), items))

    def close(self) -> None:
        self.pool.shutdown()


_BASELINE_TAIL = """
_a = f({inputs})
_b = f({inputs})
if _a != _b:
    raise SystemExit("nondeterministic")
print(repr(_a))
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))


def _baseline_one(it: Item, timeout: float) -> tuple[bool, str | None]:
    program = _SURROGATE if it.host_unsafe else it.program
    code = program + "\n" + _BASELINE_TAIL.format(inputs=it.inputs)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=_limit_memory,
            env=dict(os.environ),
        )
    except subprocess.TimeoutExpired:
        return False, None
    if proc.returncode != 0:
        return False, None
    out = proc.stdout.strip().splitlines()
    return True, out[-1] if out else None


SYSTEMS = {"ours": _Ours, "azr_pool": _AzrPool, "python_c": _PythonC}


def _machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "?")
    except OSError:
        pass
    return f"{platform.machine()} {cpu}, {os.cpu_count()} cpus, Python {platform.python_version()}"


def _tree_cpu() -> float:
    """CPU seconds used so far by this process and all its descendants, live or reaped (load-independent)."""
    import psutil  # a dependency of ray, always present with verl

    me = psutil.Process()
    procs = [me]
    try:
        procs += me.children(recursive=True)
    except psutil.Error:
        pass
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def _load() -> float:
    return os.getloadavg()[0]


def _summary(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[0], xs[-1]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (systems in rotating order)")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument(
        "--python-c-n", type=int, default=150, help="python -c is slow: it runs on the first N items of each mix only"
    )
    ap.add_argument(
        "--unique",
        action="store_true",
        help="make every program text distinct (a trailing comment), so that no per-program cache helps",
    )
    ap.add_argument("--out", default=None, help="append a markdown table of the figures to this file")
    args = ap.parse_args(argv)
    items = make_mix(args.n, args.seed)
    if args.unique:
        items = [Item(it.kind, f"{it.program}\n# program {i}", it.inputs, it.host_unsafe) for i, it in enumerate(items)]
    mixes = {"bench": items, "normal": [it for it in items if it.kind == "normal"]}
    counts = {k: sum(it.kind == k for it in items) for k in ("normal", "slow", "hostile")}
    print(f"machine: {_machine()}", flush=True)
    print(
        f"mix: {counts} timeout={args.timeout}s workers={args.workers} rounds={args.rounds}"
        f"{' unique program texts' if args.unique else ''}",
        flush=True,
    )
    systems = {name: SYSTEMS[name](args.timeout, args.workers) for name in args.systems}
    rates: dict[tuple[str, str], list[float]] = {}
    cpu_ms: dict[tuple[str, str], list[float]] = {}
    loads: list[float] = []
    outputs: dict[tuple[str, str], list] = {}
    try:
        for sysobj in systems.values():  # warm-up: processes started, first fork done
            sysobj.run_many(mixes["normal"][: args.workers * 2])
        for r in range(args.rounds):
            order = list(systems)
            order = order[r % len(order) :] + order[: r % len(order)]
            for mix_name, mix in mixes.items():
                for name in order:
                    batch = mix[: args.python_c_n] if name == "python_c" else mix
                    loads.append(_load())
                    c = _tree_cpu()
                    t = time.perf_counter()
                    res = systems[name].run_many(batch)
                    dt = time.perf_counter() - t
                    cpu_ms.setdefault((mix_name, name), []).append(1000 * (_tree_cpu() - c) / len(batch))
                    rates.setdefault((mix_name, name), []).append(_rate(len(batch), dt))
                    outputs[(mix_name, name)] = res
                    print(
                        f"round {r} {mix_name:6s} {name:8s} {_rate(len(batch), dt):8.1f}/s  (load {loads[-1]:.2f})",
                        flush=True,
                    )
        prot = systems["ours"].ex.protections if "ours" in systems else {}
        notes = list(systems["ours"].ex._backend.notes) if "ours" in systems else []
    finally:
        for sysobj in systems.values():
            sysobj.close()
    figures: dict = {
        "machine": _machine(),
        "n": len(items),
        "mix": counts,
        "timeout_s": args.timeout,
        "workers": args.workers,
        "rounds": args.rounds,
        "load_min": min(loads),
        "load_max": max(loads),
        "protections_on": sorted(k for k, v in prot.items() if v),
        "protections_off": sorted(k for k, v in prot.items() if not v),
        "rates": {},
    }
    print(f"\nload average during the run: {min(loads):.2f}..{max(loads):.2f}")
    print(
        f"ours: protections on: {', '.join(figures['protections_on'])}; off: "
        f"{', '.join(figures['protections_off']) or 'none'}" + (f" ({'; '.join(notes)})" if notes else "")
    )
    header = "| validations/s (median, min..max) | " + " | ".join(systems) + " |"
    lines = [header, "|---" * (len(systems) + 1) + "|"]

    def _rows(values: dict, suffix: str, digits: int) -> None:
        # one table row per mix: median (min..max) per system, also kept in figures["rates"]
        for mix_name in mixes:
            cells = []
            for name in systems:
                med, lo, hi = _summary(values[(mix_name, name)])
                figures["rates"][f"{mix_name}/{name}{suffix}"] = {"median": med, "min": lo, "max": hi}
                cells.append(f"{med:.{digits}f} ({lo:.{digits}f}..{hi:.{digits}f})")
            lines.append(f"| {mix_name} | " + " | ".join(cells) + " |")

    _rows(rates, "", 0)
    lines.append("| **CPU ms per validation** (median, all processes) | " + " | ".join(systems) + " |")
    _rows(cpu_ms, "/cpu_ms", 2)
    if "ours" in systems and "azr_pool" in systems:
        for mix_name in mixes:
            ratio = figures["rates"][f"{mix_name}/ours"]["median"] / figures["rates"][f"{mix_name}/azr_pool"]["median"]
            figures[f"ours_over_azr_{mix_name}"] = ratio
            lines.append(f"| ours / azr_pool, {mix_name} | {ratio:.2f}x |" + " |" * (len(systems) - 1))
    if "ours" in systems:
        mix = mixes["bench"]
        res = outputs[("bench", "ours")]
        normal_ok = sum(1 for it, (ok, _) in zip(mix, res) if it.kind == "normal" and ok)
        hostile_rejected = sum(1 for it, (ok, _) in zip(mix, res) if it.kind == "hostile" and not ok)
        figures.update(normal_ok=normal_ok, hostile_rejected=hostile_rejected)
        if "azr_pool" in systems:
            ref = outputs[("bench", "azr_pool")]
            figures["normal_agree_with_azr_pool"] = sum(
                1 for it, a, b in zip(mix, res, ref) if it.kind == "normal" and a[0] and b[0] and a[1] == b[1]
            )
        lines.append(
            f"\nours: normal ok {normal_ok}/{counts['normal']}, hostile rejected "
            f"{hostile_rejected}/{counts['hostile']}, identical to azr_pool "
            f"{figures.get('normal_agree_with_azr_pool', '-')}"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(f"\nmachine: {figures['machine']}; load {min(loads):.2f}..{max(loads):.2f}\n\n{table}\n")
    return figures


if __name__ == "__main__":
    main()
