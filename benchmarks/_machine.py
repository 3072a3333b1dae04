"""What machine a benchmark ran on: every benchmark prints this with its table."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> float:
    """The 1-minute load average (NaN where the OS has none): timings are noisy above the core count."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
