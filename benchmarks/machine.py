"""What machine a benchmark ran on, for the figures it saves."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo, where ``platform.processor()`` is empty; elsewhere what
    ``platform`` knows), or 'unknown'."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
