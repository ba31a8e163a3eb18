"""Host memory: run the process with glibc's malloc backing its large blocks by transparent huge pages.

Why: XLA:CPU allocates a program's temporary buffers afresh at every execution (hundreds of MB for a
training step), and glibc serves blocks that large with a new ``mmap`` each time, so every 4 KiB page of
them is faulted in and zeroed again on every call. With ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` malloc
asks the kernel for transparent huge pages (2 MiB) for those blocks: far fewer page faults, less system
time and fewer TLB misses, for training steps and large inference calls alike; programs with small
temporaries neither gain nor lose (see docs/performance.md, "Huge pages").

glibc reads its tunables once, when a process starts, so the setting cannot be made from inside a running
interpreter: ``restart_with_huge_pages`` re-executes the command with it (train.py, evaluate.py and the
benchmarks ``benchmarks/throughput.py`` and ``benchmarks/train_throughput.py`` call it first thing). From
Python, start the interpreter with the variable set yourself.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
SETTING = f"{TUNABLE}=1"
OPT_OUT = "MVMOE_JAX_HUGE_PAGES"          # "0": leave the allocator as it is
_THP_MODES = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_version() -> tuple[int, ...] | None:
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return None
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


def transparent_huge_pages_available(modes_file: str = _THP_MODES) -> bool:
    """Whether malloc can get transparent huge pages here: Linux with glibc >= 2.35 (the tunable's first
    release) and the kernel's THP mode ``always`` or ``madvise`` (not ``never``)."""
    if not sys.platform.startswith("linux"):
        return False
    version = _glibc_version()
    if version is None or version < (2, 35):
        return False
    try:
        with open(modes_file) as f:
            modes = f.read()
    except OSError:
        return False
    return "[always]" in modes or "[madvise]" in modes


def huge_pages_requested(environ=None) -> bool:
    """Whether ``GLIBC_TUNABLES`` (of ``environ``, default this process's) already sets the tunable."""
    environ = os.environ if environ is None else environ
    return any(item.split("=", 1)[0] == TUNABLE for item in environ.get("GLIBC_TUNABLES", "").split(":"))


def environment_with_huge_pages(environ=None) -> dict[str, str]:
    """A copy of ``environ`` with the tunable appended to any ``GLIBC_TUNABLES`` already there."""
    env = dict(os.environ if environ is None else environ)
    if not huge_pages_requested(env):
        env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES", ""), SETTING) if t)
    return env


def restart_with_huge_pages() -> None:
    """Re-execute this command (``sys.orig_argv``, same interpreter) with the tunable set, unless it is set
    already, ``MVMOE_JAX_HUGE_PAGES=0``, or the platform cannot use it; then it returns and nothing
    changes. The process image is replaced, so call it first thing: anything done before it (importing
    JAX, parsing arguments) is done again by the restarted process.
    """
    if os.environ.get(OPT_OUT, "1") == "0" or huge_pages_requested() or not transparent_huge_pages_available():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, list(sys.orig_argv), environment_with_huge_pages())
    except OSError as e:       # no usable interpreter path: run on without the setting
        print(f"note: could not restart with {SETTING} ({e}); continuing without it", file=sys.stderr)
