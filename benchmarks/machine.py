"""What machine a benchmark ran on, for the figures it saves; writing a report beside it."""

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


def jax_device() -> str:
    """JAX's first device with its backend, the core count and the CPU model, as the reports name the machine."""
    import os

    import jax

    return f"{jax.devices()[0].device_kind} ({jax.default_backend()}, {os.cpu_count()} cpus, {cpu_model()})"


def default_output(name: str) -> str:
    """benchmarks/results/<name>_<today>.json, where a report goes unless told otherwise."""
    import datetime
    import os

    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    return os.path.join(results, f"{name}_{datetime.date.today().isoformat()}.json")


def write_report(report: dict, output: str, markdown_text: str) -> None:
    """``report`` as JSON at ``output`` and ``markdown_text`` beside it (``.md``), the markdown printed; the
    folder is made if missing."""
    import json
    import os

    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(report, f, indent=1)
    stem = os.path.splitext(output)[0]
    with open(stem + ".md", "w") as f:
        f.write(markdown_text + "\n")
    print(markdown_text)
    print(f"wrote {output}, {stem}.md")


def repository_commit() -> str:
    """The short commit of the repository these benchmarks belong to, or 'unknown' outside git."""
    import os
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
