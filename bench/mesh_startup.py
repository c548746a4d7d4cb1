"""How much of the test suite's mesh runs is start-up: for every run directory under the given
roots (a `logs/` folder with service logs, as `make test` leaves them under pytest's basetemp, e.g.
``/tmp/pytest-of-$USER/pytest-N/popen-gw0``), the seconds from the first service log's first line
to the last service's ``ready`` line, against the seconds from that first line to the run's last
log line. Prints the sums and the runs with the longest start-ups.

    .venv/bin/python bench/mesh_startup.py /tmp/pytest-of-root/pytest-14/popen-gw0

A service logs its first line after its imports, so the start-up counted here begins after the
first service's imports (the environment's, the lightest) and is a slight undercount.
"""

from __future__ import annotations

import argparse
import re
from datetime import datetime
from pathlib import Path

SERVICE_LOG = re.compile(r"(store|grader|rollout|learner|environment|evaluator)-\d+\.log$")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _stamp(line: str) -> float | None:
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def run_times(logs: Path) -> tuple[float, float, float] | None:
    """(first line, last service ready, last line) of the run whose service logs are in `logs`."""
    first, ready, last = [], [], []
    for path in sorted(p for p in logs.glob("*.log") if SERVICE_LOG.match(p.name)):
        lines = path.read_text(errors="replace").splitlines()
        stamps = [t for t in map(_stamp, lines) if t is not None]
        if not stamps:
            continue
        first.append(stamps[0])
        last.append(stamps[-1])
        readies = [t for line in lines if line.rstrip().endswith(" ready") and (t := _stamp(line)) is not None]
        if readies:
            ready.append(readies[0])  # a restarted service appends to its log: its first start counts
    return (min(first), max(ready), max(last)) if first and ready else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("roots", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    runs = [(logs.parent, t) for root in args.roots for logs in sorted(root.rglob("logs"))
            if logs.is_dir() and (t := run_times(logs)) is not None]
    if not runs:
        raise SystemExit("no run directory with service logs under " + ", ".join(map(str, args.roots)))
    start = sum(ready - first for _, (first, ready, _) in runs)
    span = sum(last - first for _, (first, _, last) in runs)
    print(f"{len(runs)} mesh runs: start-up (first log line -> last service ready) {start:.0f} s of "
          f"{span:.0f} s spanned ({100 * start / span:.0f} %)")
    for run, (first, ready, last) in sorted(runs, key=lambda r: r[1][1] - r[1][0], reverse=True)[:args.top]:
        print(f"  {ready - first:6.1f} s of {last - first:6.1f} s  {run}")


if __name__ == "__main__":
    main()
