"""Executor benchmark: validations/second on an AZR-style program mix, sandboxed vs a naive baseline.

    python -m populora_verl.bench.executor [--n 600] [--timeout 1.0] [--workers N] [--seed 0] [--out FILE.md]

Both sides get the same programs, the same timeout, the same number of parallel slots, and do the same work per
program (run ``f(<inputs>)`` twice, compare, ``repr``). The baseline is what one writes without a sandbox: a fresh
``python -c`` subprocess per program (this interpreter, no isolation; only an address-space rlimit so that the
memory bomb cannot take the host down). Programs that would harm the host when run unsandboxed (fork bomb,
killing the parent) are replaced by an equally cheap failing program on the baseline side only.

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
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from populora_verl.executor import Executor

__all__ = ["Item", "make_mix", "run_sandboxed", "run_baseline", "main"]


@dataclass(frozen=True)
class Item:
    kind: str  # normal | slow | hostile
    program: str
    inputs: str
    host_unsafe: bool = False


_NORMAL = [
    ("def f(s):\n    return ''.join(c for c in s if c not in 'aeiou')[::-1]", lambda r: repr(_word(r))),
    ("def f(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if c.isalpha() else c for c in s)",
     lambda r: f"{_word(r)!r}, {r.randint(1, 25)}"),
    ("def f(s):\n    best = ''\n    for i in range(len(s)):\n        for j in range(i + 1, len(s) + 1):\n"
     "            t = s[i:j]\n            if t == t[::-1] and len(t) > len(best):\n                best = t\n    return best",
     lambda r: repr(_word(r, 12))),
    ("def f(xs):\n    out, acc = [], 0\n    for x in xs:\n        acc += x\n        out.append(acc)\n    return out",
     lambda r: repr([r.randint(-9, 9) for _ in range(r.randint(3, 12))])),
    ("def f(xs, k):\n    return max(sum(xs[i:i + k]) for i in range(len(xs) - k + 1))",
     lambda r: f"{[r.randint(-9, 9) for _ in range(10)]!r}, {r.randint(1, 5)}"),
    ("def f(xs):\n    return sorted(set(xs), key=lambda x: (xs.count(x), -x), reverse=True)",
     lambda r: repr([r.randint(0, 5) for _ in range(12)])),
    ("def f(words):\n    d = {}\n    for w in words:\n        d[len(w)] = d.get(len(w), []) + [w]\n"
     "    return {k: sorted(v) for k, v in sorted(d.items())}", lambda r: repr([_word(r) for _ in range(6)])),
    ("from collections import Counter\ndef f(s):\n    c = Counter(s)\n    return sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:3]",
     lambda r: repr(_word(r, 20))),
    ("def f(d):\n    return {v: k for k, v in d.items() if isinstance(v, int) and v % 2 == 0}",
     lambda r: repr({_word(r, 3): r.randint(0, 9) for _ in range(5)})),
    ("def f(n):\n    steps = 0\n    while n != 1:\n        n = n // 2 if n % 2 == 0 else 3 * n + 1\n        steps += 1\n    return steps",
     lambda r: str(r.randint(2, 10**5))),
    ("def f(n):\n    return sum(i * i for i in range(n) if i % 3 == 0)", lambda r: str(r.randint(10, 5000))),
    ("def f(n, memo={}):\n    if n < 2:\n        return n\n    if n not in memo:\n        memo[n] = f(n - 1) + f(n - 2)\n    return memo[n]",
     lambda r: str(r.randint(5, 90))),
    ("def f(xs):\n    if len(xs) <= 1:\n        return xs\n    p = xs[0]\n"
     "    return f([x for x in xs[1:] if x < p]) + [p] + f([x for x in xs[1:] if x >= p])",
     lambda r: repr([r.randint(0, 99) for _ in range(15)])),
    ("from itertools import permutations\ndef f(s):\n    return sorted({''.join(p) for p in permutations(s)})[:5]",
     lambda r: repr(_word(r, 5))),
    ("def f(a, b):\n    while b:\n        a, b = b, a % b\n    return a", lambda r: f"{r.randint(1, 10**6)}, {r.randint(1, 10**6)}"),
    ("def f(m):\n    return [list(row) for row in zip(*m)]",
     lambda r: repr([[r.randint(0, 9) for _ in range(3)] for _ in range(3)])),
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
    items = [Item("hostile", *_HOSTILE[i % len(_HOSTILE)][:1], "1", _HOSTILE[i % len(_HOSTILE)][1])
             for i in range(n_hostile)]
    # 0.2-0.6 s for both determinism calls together (~0.2 us per iteration on these cores)
    items += [Item("slow", _SLOW, str(r.randint(5 * 10**5, 15 * 10**5))) for _ in range(n_slow)]
    for _ in range(n - len(items)):
        prog, gen = r.choice(_NORMAL)
        items.append(Item("normal", prog, gen(r)))
    r.shuffle(items)
    return items


def run_sandboxed(items: list[Item], timeout: float, workers: int) -> tuple[float, list, dict]:
    with Executor(timeout_s=timeout, memory_mb=512, max_workers=workers) as ex:
        ex.run_many([(it.program, it.inputs) for it in items[:workers]])  # warm-up: workers already started
        t = time.perf_counter()
        results = ex.run_many([(it.program, it.inputs) for it in items])
        elapsed = time.perf_counter() - t
        return elapsed, results, ex.protections


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
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              preexec_fn=_limit_memory, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return False, None
    if proc.returncode != 0:
        return False, None
    out = proc.stdout.strip().splitlines()
    return True, out[-1] if out else None


def run_baseline(items: list[Item], timeout: float, workers: int) -> tuple[float, list]:
    with ThreadPoolExecutor(workers) as pool:
        t = time.perf_counter()
        from tqdm.auto import tqdm

        results = list(tqdm(pool.map(lambda it: _baseline_one(it, timeout), items), total=len(items),
                            desc="baseline", unit="program", disable=None))
        return time.perf_counter() - t, results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append a markdown table of the figures to this file")
    args = ap.parse_args(argv)
    items = make_mix(args.n, args.seed)
    counts = {k: sum(it.kind == k for it in items) for k in ("normal", "slow", "hostile")}
    print(f"mix: {counts} timeout={args.timeout}s workers={args.workers} cpus={os.cpu_count()}", flush=True)

    t_sb, res_sb, prot = run_sandboxed(items, args.timeout, args.workers)
    t_bl, res_bl = run_baseline(items, args.timeout, args.workers)
    agree = sum(1 for it, a, (ok, out) in zip(items, res_sb, res_bl) if it.kind == "normal" and a.ok and ok
                and a.output == out)
    normal_ok = sum(1 for it, a in zip(items, res_sb) if it.kind == "normal" and a.ok)
    hostile_rejected = sum(1 for it, a in zip(items, res_sb) if it.kind == "hostile" and not a.ok)
    rate_sb, rate_bl = len(items) / t_sb, len(items) / t_bl
    on = sorted(k for k, v in prot.items() if v)
    off = sorted(k for k, v in prot.items() if not v)
    figures = {"n": len(items), "mix": counts, "timeout_s": args.timeout, "workers": args.workers,
               "sandboxed_s": t_sb, "baseline_s": t_bl, "sandboxed_per_s": rate_sb, "baseline_per_s": rate_bl,
               "speedup": rate_sb / rate_bl, "normal_ok": normal_ok, "normal_agree_with_baseline": agree,
               "hostile_rejected": hostile_rejected, "protections_on": on, "protections_off": off}
    print(f"sandboxed: {t_sb:7.2f} s  {rate_sb:8.1f} validations/s  (protections on: {', '.join(on)};"
          f" off: {', '.join(off) or 'none'})")
    print(f"baseline : {t_bl:7.2f} s  {rate_bl:8.1f} validations/s  (fresh `python -c` per program, no isolation)")
    print(f"speedup  : {rate_sb / rate_bl:.1f}x   normal ok {normal_ok}/{counts['normal']}, identical outputs "
          f"{agree}, hostile rejected {hostile_rejected}/{counts['hostile']}")
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(f"\n| machine | n | mix (normal/slow/hostile) | timeout | workers | sandboxed /s | baseline /s |"
                     f" speedup |\n|---|---|---|---|---|---|---|---|\n| {platform.machine()} {os.cpu_count()} cpu, "
                     f"Python {platform.python_version()} | {len(items)} | {counts['normal']}/{counts['slow']}/"
                     f"{counts['hostile']} | {args.timeout} s | {args.workers} | {rate_sb:.1f} | {rate_bl:.1f} |"
                     f" {rate_sb / rate_bl:.1f}x |\n")
    return figures


if __name__ == "__main__":
    main()
