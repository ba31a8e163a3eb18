"""Which devices a run uses: the one-axis data mesh, and a CPU's cores presented as separate devices
(with 512-bit vectors asked of XLA:CPU where the CPU has AVX-512); and how much memory a compiled program
needs on each.

Why split a CPU: a decoding step is many small operations. XLA:CPU runs one program's operations one
after another, each spread over the cores, and the cores wait on each other between them. Presented as
separate devices, the cores each run their own share of the batch (their own decoding loop) with nothing
to wait for, with identical results (see docs/performance.md, "Cores as devices").
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import numpy as np
from jax.sharding import Mesh

DATA_AXIS = "data"
_FORCE_FLAG = "--xla_force_host_platform_device_count"
_VECTOR_WIDTH_FLAG = "--xla_cpu_prefer_vector_width"
_WIDE_VECTORS = f"{_VECTOR_WIDTH_FLAG}=512"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                       # macOS, Windows
        return os.cpu_count() or 1


def largest_divisor_at_most(limit: int, *sizes: int) -> int:
    """The largest d <= ``limit`` dividing every one of ``sizes`` (1 when there is none larger)."""
    for d in range(max(limit, 1), 1, -1):
        if all(s % d == 0 for s in sizes):
            return d
    return 1


@functools.lru_cache(maxsize=None)
def cpu_has_avx512() -> bool:
    """Whether the host CPU reports AVX-512 (``avx512f`` among Linux's /proc/cpuinfo flags; False where
    that file is missing or unreadable). XLA:CPU's small matmul kernels differ by instruction set, and so
    does which way of writing some products is faster (see ``attention.products_against_transposes``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512f" in line.split()
    except OSError:
        pass
    return False


def xla_flags_with_wide_vectors(flags: str, avx512: bool) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) asking XLA:CPU for 512-bit vectors in the loops it generates,
    where the CPU has AVX-512 (``avx512``) and ``flags`` choose no width themselves; otherwise unchanged.

    XLA:CPU prefers 256-bit vectors by default, even on AVX-512 CPUs; the decoding step's many small
    elementwise fusions (masks, score gathers, normalisations) run faster with 512-bit ones (see
    docs/performance.md, "512-bit vectors").
    """
    if not avx512 or _VECTOR_WIDTH_FLAG in flags:
        return flags
    return f"{flags} {_WIDE_VECTORS}".strip()


def prefer_wide_vectors() -> bool:
    """Adds ``xla_flags_with_wide_vectors`` to this process's ``XLA_FLAGS`` (XLA reads them at JAX's first
    compilation, so call it before any: ``use_cpu_cores_as_devices`` does). A width already given in
    ``XLA_FLAGS`` wins. Returns whether the flags now ask for 512-bit vectors."""
    flags = xla_flags_with_wide_vectors(os.environ.get("XLA_FLAGS", ""), cpu_has_avx512())
    if flags:
        os.environ["XLA_FLAGS"] = flags
    return _WIDE_VECTORS in flags


def use_cpu_cores_as_devices(count: int | None = None) -> int:
    """Present the CPU as ``count`` JAX devices (default: one per usable core). Call it before JAX runs
    anything (the setting is read when the backends start); it does not affect accelerators, which keep
    their own devices. ``XLA_FLAGS`` naming ``--xla_force_host_platform_device_count`` wins over it.
    On an AVX-512 CPU it also asks XLA:CPU for 512-bit vectors (``prefer_wide_vectors``).

    Returns the number of CPU devices asked for (1: left as JAX's default). Raises RuntimeError when JAX's
    backends have already started with another number of CPU devices.
    """
    prefer_wide_vectors()
    if _FORCE_FLAG in os.environ.get("XLA_FLAGS", ""):
        return len(jax.devices("cpu"))
    count = usable_cores() if count is None else int(count)
    if count < 1:
        raise ValueError(f"the number of CPU devices must be at least 1, got {count}")
    if count == 1:
        return 1
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != count:
            raise RuntimeError(f"cannot present the CPU as {count} devices: JAX has already started with "
                               f"{have}; call use_cpu_cores_as_devices before any JAX computation") from None
        warnings.warn("use_cpu_cores_as_devices called after JAX started; the CPU devices were already "
                      f"{have}", stacklevel=2)
    return count


def use_cpu_devices(count: int, *batch_sizes: int, what: str = "cpu_devices") -> int:
    """An entry point's setting of CPU devices: ``count`` devices, or with 0 one per usable core, reduced to
    the largest count that divides every one of ``batch_sizes``. Before any JAX computation; returns it."""
    count = int(count)
    if count < 0:
        raise ValueError(f"{what} must be >= 0 (0: one per core), got {count}")
    return use_cpu_cores_as_devices(count or largest_divisor_at_most(usable_cores(), *batch_sizes))


def make_mesh(devices=None) -> Mesh:
    """A one-axis (``'data'``) mesh over ``devices`` (default: every device of every process)."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def local_mesh(num_devices: int | None = None) -> Mesh:
    """A data mesh over the first ``num_devices`` devices of this process (default: all of them)."""
    local = jax.local_devices()
    n = len(local) if num_devices is None else num_devices
    if not 1 <= n <= len(local):
        raise ValueError(f"num_devices must be between 1 and the {len(local)} local devices, got {n}")
    return make_mesh(local[:n])


def program_memory_bytes(compiled) -> int:
    """Device memory a compiled program needs, from XLA's memory analysis: its arguments, outputs and
    temporaries (less the outputs that reuse donated arguments). Per device for a multi-device program."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
