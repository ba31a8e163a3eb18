"""Runs over several processes (``jax.distributed``): the launch settings, and what the processes share.

Every process runs the same program on its own devices; the processes form one global device mesh and
exchange gradients through XLA's cross-process collectives (on CPUs, JAX's gloo implementation over TCP).
A launch names the coordinator (process 0's address and a free port), the number of processes and each
one's index, or leaves all three out where ``jax.distributed.initialize`` reads them from the cluster
(SLURM, Open MPI, a cloud TPU).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

CPU_COLLECTIVES = "gloo"


class ProcessFailure(RuntimeError):
    """A computation failed in a run of several processes, most often because another process stopped."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins a run of several. ``coordinator_address`` (host:port), ``num_processes`` and
    ``process_id`` are given together or not at all (None: detected from the cluster's environment);
    a process that sends no heartbeat for ``heartbeat_timeout_seconds`` counts as dead, and the others
    stop."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_seconds: int = 100

    def __post_init__(self):
        given = {"coordinator_address": self.coordinator_address, "num_processes": self.num_processes,
                 "process_id": self.process_id}
        missing = [k for k, v in given.items() if v is None]
        if missing and len(missing) < len(given):
            raise ValueError(f"distributed launch: {', '.join(k for k in given if k not in missing)} given without "
                             f"{', '.join(missing)}; give coordinator_address, num_processes and process_id "
                             "together, or none of them to have them detected (SLURM, Open MPI, cloud TPU)")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be between 0 and num_processes - 1 = {self.num_processes - 1}, "
                             f"got {self.process_id}")
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise ValueError(f"coordinator_address must be host:port, got {self.coordinator_address!r}")
        if self.heartbeat_timeout_seconds < 1:
            raise ValueError(f"heartbeat_timeout_seconds must be >= 1, got {self.heartbeat_timeout_seconds}")


def launch_from_config(config) -> Launch | None:
    """The ``Launch`` of a run config, or of any mapping with its fields (None unless ``distributed``); a
    ValueError for launch fields set on a run that is not distributed, or set inconsistently."""
    fields = {"coordinator_address": config.get("coordinator_address") or None,
              "num_processes": config.get("num_processes"), "process_id": config.get("process_id")}
    if not config.get("distributed", False):
        given = [k for k, v in fields.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} set but distributed is False: add --config.distributed=True")
        return None
    return Launch(**fields, heartbeat_timeout_seconds=int(config.get("heartbeat_timeout_seconds", 100)))


def initialize(launch: Launch | None) -> bool:
    """Join the run described by ``launch`` (None: a single process; nothing to do), before anything
    touches JAX's devices. On CPUs the cross-process collectives are JAX's gloo unless another
    implementation was chosen. Called again once joined, it does nothing. Returns whether this process
    is part of a distributed run."""
    if launch is None:
        return False
    if jax.distributed.is_initialized():
        return True
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    jax.distributed.initialize(coordinator_address=launch.coordinator_address,
                               num_processes=launch.num_processes, process_id=launch.process_id,
                               heartbeat_timeout_seconds=launch.heartbeat_timeout_seconds)
    return True


def is_main() -> bool:
    """Whether this is process 0, the one that writes the run's logs, metrics and plots."""
    return jax.process_index() == 0


def same_on_all(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a decision, such as stopping, that all must take together)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.bool_(flag)))


def sum_over_processes(x: np.ndarray) -> np.ndarray:
    """The elementwise sum of float32 ``x`` (same shape on every process) over the processes, on every
    process. With each process's values in its own entries and zeros elsewhere, every process gets all
    values, exactly."""
    x = np.asarray(x, np.float32)        # what crosses the processes (JAX's default: no float64)
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x)).sum(0, dtype=np.float32)


def process_batches(num_batches: int, process: int, num_processes: int) -> range:
    """The batches (indices) that ``process`` of ``num_processes`` evaluates: every num_processes-th, so
    that each batch is evaluated by exactly one process."""
    return range(process, num_batches, num_processes)


def my_batches(num_batches: int) -> range:
    """``process_batches`` of this process."""
    return process_batches(num_batches, jax.process_index(), jax.process_count())


def describe_failure(error: Exception, last_checkpoint: str) -> ProcessFailure:
    """The error to report when a computation fails on this process of a distributed run: which process,
    JAX's message, the likely cause and how to resume (``last_checkpoint`` says where from)."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return ProcessFailure(
        f"process {jax.process_index()} of {jax.process_count()}: a computation failed ({type(error).__name__}: "
        f"{first}); in a run of several processes this is most often another process having stopped (see its "
        f"log). The last checkpoint is {last_checkpoint}; start every process again with the same command to "
        "resume from it")
