"""How busy this shared machine's cores are, so that benchmarks can wait for a quiet moment and say when they
could not (imported by the bench_*.py scripts beside it)."""
from __future__ import annotations

import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cpu_jiffies() -> tuple[int, int]:
    """(total, idle) clock ticks of all cores since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]  # idle + iowait


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all cores busy over the next `interval` seconds."""
    t0, i0 = cpu_jiffies()
    time.sleep(interval)
    t1, i1 = cpu_jiffies()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_for_idle(max_wait_s: float, threshold: float = 0.15) -> float:
    """Waits (up to max_wait_s) until other processes leave the cores idle; returns the last busy fraction."""
    deadline = time.monotonic() + max_wait_s
    busy = cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        time.sleep(5)
        busy = cpu_busy()
    if busy > threshold:
        log(f"  warning: cores still {busy:.0%} busy with other work; timings will be noisy")
    return busy
