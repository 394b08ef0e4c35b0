"""GGUF → HF conversion time against the number of dequantising threads, side by side.

    python -m populora_verl.bench.convert MODEL.gguf [--workers 1 4] [--rounds 3] [--against OLD_CHECKOUT]

Each round runs ``python -m populora_verl.models convert`` once per setting, in a fresh process, in an order that
alternates between rounds (so drift of the machine's load falls on every setting alike). ``--against`` adds the same
conversion by another checkout of this package (its own default settings), e.g. the previous release, as the
reference row. It prints the wall time per round, the median and range per setting, the ratio of medians to the
first setting, the machine (CPUs, load average before and after), and whether every setting wrote the same
``model.safetensors`` bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from populora_verl.bench import child

__all__ = ["run_round", "main"]


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def run_round(
    gguf: Path, out: Path, workers: int | None, dtype: str, checkout: Path | None = None
) -> tuple[float, str]:
    """(wall seconds, digest of the written weights) of one conversion in a fresh process: this package with
    ``--workers``, or the package in ``checkout`` with its own defaults (``workers`` None)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "populora_verl.models", "convert", str(gguf), str(out), "--dtype", dtype]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=checkout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"conversion ({' '.join(cmd[3:])}) failed:\n{proc.stderr[-2000:]}")
    return wall, _digest(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m populora_verl.bench.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, os.cpu_count() or 1],
        help="thread counts to compare; the first is the reference (default: 1 and this machine's CPUs)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="also time another checkout of this package (its defaults), as the reference row",
    )
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where the conversions are written (default: a temporary folder next to the GGUF, removed at the end)",
    )
    args = ap.parse_args(argv)
    if not args.gguf.is_file():
        ap.error(f"gguf {args.gguf}: no such file")
    if args.rounds < 1 or any(w < 1 for w in args.workers) or len(set(args.workers)) != len(args.workers):
        ap.error("--rounds and --workers must be at least 1, and the worker counts distinct")
    if args.against is not None and not (args.against / "populora_verl" / "models.py").is_file():
        ap.error(f"--against {args.against}: not a checkout of this package (no populora_verl/models.py)")
    # (label, workers, checkout): the first row is the reference of the ratios
    settings: list[tuple[str, int | None, Path | None]] = [(f"workers {w}", w, None) for w in args.workers]
    if args.against is not None:
        settings.insert(0, (f"{args.against.name}, its defaults", None, args.against.resolve()))
    base = Path(tempfile.mkdtemp(prefix=".bench-convert.", dir=args.out_dir or args.gguf.parent))
    times: dict[str, list[float]] = {s[0]: [] for s in settings}
    digests: set[str] = set()
    load_before = os.getloadavg()
    try:
        for r, (label, workers, checkout) in child.alternating(settings, args.rounds):
            wall, digest = run_round(args.gguf, base / "out", workers, args.dtype, checkout)  # emptied by each run
            times[label].append(wall)
            digests.add(digest)
            print(f"round {r + 1} {label}: {wall:.1f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load_after = os.getloadavg()
    ref_label = settings[0][0]
    ref = statistics.median(times[ref_label])
    print(
        f"\n{args.gguf.name} -> {args.dtype}; {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; {args.rounds} rounds, order alternating\n"
    )
    print(f"| setting | median s | min-max s | × {ref_label} |")
    print("|---|---|---|---|")
    for label, _, _ in settings:
        med = statistics.median(times[label])
        print(f"| {label} | {med:.1f} | {min(times[label]):.1f}-{max(times[label]):.1f} | {med / ref:.2f} |")
    same = len(digests) == 1
    print(f"\nweights identical across settings and rounds: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
