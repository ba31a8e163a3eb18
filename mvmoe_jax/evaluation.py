"""Datasets -> objectives, gaps and times.

Evaluation is greedy POMO decoding (all starts, optionally x8 augmentation) in fixed-size jitted batches:
the last batch is padded with copies so one compiled function serves the whole dataset, and compilation
is done ahead of time so that the reported seconds exclude it. Every best route is replayed through the
environment's checker, so an objective is only reported for a route the environment accepts.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from mvmoe_jax import checker, distributed
from mvmoe_jax.instances import Instance, take
from mvmoe_jax.nn.policy import PolicyConfig
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.rollout import compile_greedy_evaluate, replicated


# The fields of a batch's GreedyResult that hold one row per instance.
PER_INSTANCE = ("obj", "obj_no_aug", "best_actions")


@dataclasses.dataclass
class DatasetResult:
    """obj / obj_no_aug: per-instance best cost with / without augmentation (float64 (K,); +inf where no
    rollout finished: every start ran into a dead end, as the classic backhaul rule allows); routes: the best
    route per instance in the paper's flat format (an unfinished one where obj is +inf); seconds: decoding wall
    time without compilation; compile_seconds: ahead-of-time compilation."""

    obj: np.ndarray
    obj_no_aug: np.ndarray
    routes: list[list[int]]
    seconds: float
    compile_seconds: float

    @property
    def solved(self) -> np.ndarray:
        """bool (K,): the instances with a finished route."""
        return np.isfinite(self.obj)

    @property
    def mean(self) -> float:
        """Mean objective over the solved instances (NaN when none is)."""
        return float(np.mean(self.obj[self.solved])) if self.solved.any() else float("nan")

    @property
    def mean_no_aug(self) -> float:
        """Mean objective without augmentation over the instances it solved (NaN when none)."""
        ok = np.isfinite(self.obj_no_aug)
        return float(np.mean(self.obj_no_aug[ok])) if ok.any() else float("nan")


def pad_batch(inst: Instance, size: int) -> Instance:
    """Pad a batch to ``size`` instances by repeating its first instance."""
    have = inst.locs.shape[0]
    if have == size:
        return inst
    idx = np.concatenate([np.arange(have), np.zeros(size - have, np.int64)])
    return take(inst, idx)


def padded_batches(inst: Instance, batch_size: int) -> Iterator[tuple[int, int, Instance]]:
    """(lo, hi, batch) over the K instances of ``inst`` in order: instances lo..hi-1 in a batch of exactly
    ``batch_size`` (the last one padded by ``pad_batch``), so that one compiled function serves them all."""
    k = inst.locs.shape[0]
    for lo in range(0, k, batch_size):
        hi = min(lo + batch_size, k)
        yield lo, hi, pad_batch(take(inst, np.arange(lo, hi)), batch_size)


def evaluate_dataset(cfg: PolicyConfig, params, inst: Instance, *, pomo_size: int | None = None,
                     augment: bool = True, batch_size: int = 64, seed: int = 0,
                     progress: bool = True, desc: str = "eval", check_routes: bool = True,
                     chunk_size: int | None = None, plan: ExecutionPlan | None = None) -> DatasetResult:
    """Greedy evaluation of a batched Instance (K instances) in jitted batches of ``batch_size``
    (each decoded ``chunk_size`` augmented instances at a time, see ``rollout.greedy_evaluate``), run as the
    execution ``plan`` says (None: the default backend's preset). In a run of several processes
    (``jax.distributed``) each decodes every num_processes-th batch on its own devices and all return the
    whole result. An instance none of whose rollouts finished keeps obj +inf (``DatasetResult.solved``); the
    routes of the others are checked."""
    checker.validate_instances(inst, desc)
    k = inst.locs.shape[0]
    n = inst.locs.shape[1] - 1
    pomo = n if pomo_size is None else pomo_size
    bs = min(batch_size, k)
    rng = jax.random.key(seed)

    t0 = time.perf_counter()
    params = replicated(params)           # once, not at every batch
    first = pad_batch(take(inst, np.arange(min(bs, k))), bs)
    compiled = compile_greedy_evaluate(cfg, params, first, rng, pomo_size=pomo, augment=augment,
                                       chunk_size=chunk_size, plan=plan)
    compile_s = time.perf_counter() - t0

    # With several processes each one decodes its share of the batches; all get every result.
    mine = distributed.my_batches(-(-k // bs))
    spec = compiled.output_spec()
    out = {name: np.zeros((k,) + getattr(spec, name).shape[1:], np.float32) for name in PER_INSTANCE}
    t0 = time.perf_counter()
    batches = tqdm(padded_batches(inst, bs), total=-(-k // bs), desc=desc, disable=not progress, leave=False)
    for i, (lo, hi, batch) in enumerate(batches):
        if i not in mine:
            continue
        res = compiled(params, batch, jax.random.fold_in(rng, i))
        res = jax.device_get(res)
        for name in PER_INSTANCE:
            out[name][lo:hi] = getattr(res, name)[: hi - lo]
    out = {name: distributed.sum_over_processes(x) for name, x in out.items()}     # actions: exact in float32
    seconds = time.perf_counter() - t0

    routes = [checker.actions_to_route(a) for a in out["best_actions"].astype(np.int64)]
    result = DatasetResult(obj=out["obj"].astype(np.float64), obj_no_aug=out["obj_no_aug"].astype(np.float64),
                           routes=routes, seconds=seconds, compile_seconds=compile_s)
    if check_routes and result.solved.any():
        solved = np.flatnonzero(result.solved)
        source = desc if len(solved) == k else f"{desc} (its {len(solved)} solved instances, renumbered)"
        checker.verify_routes(take(inst, solved), [result.routes[i] for i in solved], result.obj[solved],
                              source=source)
    return result


def gap_percent(obj: np.ndarray, reference: np.ndarray) -> float:
    """Mean per-instance gap in percent, as the paper reports it."""
    obj = np.asarray(obj, np.float64)
    ref = np.asarray(reference, np.float64)
    if obj.shape != ref.shape:
        raise ValueError(f"{obj.shape[0]} objectives but {ref.shape[0]} reference values")
    return float(np.mean((obj - ref) / ref) * 100.0)
