"""What the command-line entry points do, as plain functions (train.py / evaluate.py only parse flags)."""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any

import ml_collections
import numpy as np

from mvmoe_jax import checker, checkpoints, evaluation, execution, io, precision, problems
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.nn.policy import PolicyConfig, distance_bias_of, refuse_fixed_bias_on_learned


DEFAULT_EVAL_BATCH = 64
# PolicyConfig fields that change how a trained policy decodes, not its parameters (nn/locality.py).
DECODING_OPTIONS = ("distance_bias", "candidates")


def policy_config(model: ml_collections.ConfigDict | dict) -> PolicyConfig:
    """config.model (ConfigDict; expert_loc as a comma string, capacity_factor 0 = none) -> PolicyConfig."""
    d = dict(model.to_dict() if hasattr(model, "to_dict") else model)
    loc = d.get("expert_loc", ())
    if isinstance(loc, str):
        d["expert_loc"] = tuple(s.strip() for s in loc.split(",") if s.strip())
    if not d.get("capacity_factor"):
        d["capacity_factor"] = None
    return PolicyConfig.from_dict(d)


def with_compute_dtype(cfg: PolicyConfig, flags: Any) -> PolicyConfig:
    """The policy with the matmul input dtype given on the command line (bfloat16 changes rounding)."""
    if getattr(flags, "compute_dtype", None):
        return dataclasses.replace(cfg, compute_dtype=flags.compute_dtype)
    return cfg


def with_decoding_options(cfg: PolicyConfig, flags: Any) -> PolicyConfig:
    """The policy with the distance-aware decoding options given on the command line (``--distance_bias``,
    ``--candidates``; ``nn/locality.py``), the config's own where a flag is absent."""
    options = {name: getattr(flags, name) for name in DECODING_OPTIONS if getattr(flags, name, None) is not None}
    refuse_fixed_bias_on_learned(cfg, options.get("distance_bias"))
    return dataclasses.replace(cfg, **options) if options else cfg


def decoding_options(cfg: PolicyConfig, params) -> dict[str, Any]:
    """{option: value} of the distance-aware decoding options a policy decodes with (for reports); a learned
    bias is given by its value, with ``learned_distance_bias``."""
    options = {name: getattr(cfg, name) for name in DECODING_OPTIONS}
    if cfg.learned_distance_bias:
        options.update(distance_bias=distance_bias_of(cfg, params), learned_distance_bias=True)
    return options


def execution_plan_of(flags: Any) -> ExecutionPlan:
    """The execution plan that ``--execution`` (a preset) and ``--execution_overrides`` name, on JAX's
    default backend."""
    return execution.default_plan(getattr(flags, "execution", "auto"),
                                  **execution.parse_overrides(getattr(flags, "execution_overrides", "") or ""))


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[tuple[str, float, float, float | None, float]]) -> None:
    print(f"{'variant':10s} {'obj':>9s} {'obj_no_aug':>10s} {'gap %':>8s} {'time s':>8s}")
    for name, obj, no_aug, gap, secs in rows:
        print(f"{name:10s} {obj:9.4f} {no_aug:10.4f} {_fmt(gap, '8.3f'):>8s} {secs:8.2f}")


def run_evaluation(config: ml_collections.ConfigDict | None, flags: Any) -> dict:
    """Evaluate a checkpoint on the paper's datasets (``flags.data_dir``) or on CVRPLIB / Solomon files
    (``flags.vrplib_dir``). With ``config`` None the checkpoint's own model configuration is used.
    Matmuls run at ``flags.matmul_precision``, else the config's ``eval_matmul_precision``, else full float32
    (see mvmoe_jax/precision.py). Returns the JSON-ready results."""
    prec = getattr(flags, "matmul_precision", None) or (
        config.get("eval_matmul_precision", precision.EVAL_DEFAULT) if config is not None else precision.EVAL_DEFAULT)
    with precision.matmul_precision(precision.check(prec)):
        return _run_evaluation(config, flags)


def _run_evaluation(config: ml_collections.ConfigDict | None, flags: Any) -> dict:
    wanted = None if config is None else policy_config(config.model)
    cfg, params = checkpoints.load_policy(flags.checkpoint, wanted)
    cfg = with_decoding_options(with_compute_dtype(cfg, flags), flags)
    plan = execution_plan_of(flags)
    if flags.aug not in (1, 8):
        raise ValueError(f"--aug must be 1 or 8, got {flags.aug}")
    batch_size = flags.batch_size or (config.eval_batch_size if config is not None else DEFAULT_EVAL_BATCH)
    print(f"model {cfg.model} from {flags.checkpoint}"
          + ("" if not cfg.uses_locations else f"; decoding with {decoding_options(cfg, params)}"))
    if flags.vrplib_dir:
        return _evaluate_vrplib(cfg, params, flags, batch_size, plan)
    if not flags.data_dir:
        raise ValueError("give --data_dir (paper datasets) or --vrplib_dir (CVRPLIB / Solomon files)")
    variants = problems.parse_variants(flags.problems)
    explicit = flags.problems.strip().upper() not in ("ALL", "TRAIN", "UNSEEN")
    if flags.reference and len(variants) != 1:
        raise ValueError("--reference applies to a single problem; use --problems=<VARIANT>")
    results, rows = {}, []
    for var in variants:
        path = io.dataset_path(flags.data_dir, var, flags.size)
        if not os.path.exists(path):
            if explicit:
                raise FileNotFoundError(f"no {var.name} dataset of size {flags.size}: {path}")
            print(f"skipping {var.name}: no dataset at {path}")
            continue
        inst = io.load_paper_instances(path, var, num_instances=flags.num_instances)
        res = evaluation.evaluate_dataset(
            cfg, params, inst, pomo_size=flags.pomo_size, augment=flags.aug == 8, batch_size=batch_size,
            seed=flags.seed, progress=flags.progress, desc=var.name, chunk_size=getattr(flags, "chunk_size", None),
            plan=plan)
        gap, ref_path = _gap(flags, var, res.obj, res.solved)
        unsolved = int((~res.solved).sum())
        results[var.name] = {"obj": _finite_or_none(res.obj), "obj_no_aug": _finite_or_none(res.obj_no_aug),
                             "mean": _finite_or_none([res.mean])[0],
                             "mean_no_aug": _finite_or_none([res.mean_no_aug])[0], "gap": gap, "unsolved": unsolved,
                             "seconds": res.seconds, "compile_seconds": res.compile_seconds,
                             "reference": os.path.basename(ref_path) if gap is not None else None,
                             **decoding_options(cfg, params)}
        rows.append((var.name, res.mean, res.mean_no_aug, gap, res.seconds))
        note = "" if not unsolved else (f"  {unsolved} of {len(res.obj)} instances unsolved (every rollout ran "
                                        "into a dead end), left out of obj and gap")
        print(f"{var.name:10s} obj {res.mean:.4f}  gap {_fmt(gap, '.3f')}%  {res.seconds:.2f}s "
              f"(compile {res.compile_seconds:.1f}s){note}", flush=True)
    if not results:
        raise FileNotFoundError(f"no datasets of size {flags.size} found under {flags.data_dir}")
    print()
    print_table(rows)
    return results


def _finite_or_none(values: np.ndarray) -> list[float | None]:
    """JSON-ready objectives: None for an unsolved instance (+inf)."""
    return [float(v) if np.isfinite(v) else None for v in values]


def _gap(flags, var, obj: np.ndarray, solved: np.ndarray) -> tuple[float | None, str]:
    """Mean gap of the ``solved`` instances to ``--reference`` (which must exist and cover every instance) or,
    when none is given, to the paper's reference solver file beside the dataset if there is one (None
    otherwise, and when no instance is solved)."""
    explicit = bool(flags.reference)
    ref_path = flags.reference or io.reference_solution_path(flags.data_dir, var, flags.size)
    if not os.path.exists(ref_path):
        if explicit:
            raise FileNotFoundError(f"--reference: no solution file at {ref_path}")
        return None, ref_path
    ref_cost, _ = io.load_paper_solutions(ref_path, num_instances=len(obj))
    if len(ref_cost) != len(obj):
        if explicit:
            raise ValueError(f"--reference {ref_path} has {len(ref_cost)} solutions for {len(obj)} instances")
        return None, ref_path
    if not solved.any():
        return None, ref_path
    return evaluation.gap_percent(obj[solved], np.asarray(ref_cost)[solved]), ref_path


def _read_benchmark_file(path: str):
    """A VRPLIB or Solomon file, told apart by its content (by its extension where the content does not say)."""
    from mvmoe_jax.io.formats import VRPLIB, text_format

    if (text_format(path) or ("VRPLIB" if path.endswith(".vrp") else "Solomon")) == VRPLIB:
        return io.read_vrplib(path)
    return io.read_solomon(path)


def _original_cost(route: list[int], inst, meta, convention: str = "exact") -> float:
    """Cost of a route (the paper's flat format) of one instance in the file's own units, each edge counted under
    ``convention`` (``checker.COST_CONVENTIONS``; the file's is ``meta.cost_convention``). Open routes do not
    return to the depot."""
    xy = meta.coords if meta.coords is not None else (
        np.asarray(inst.locs[0], np.float64) * meta.scale + np.asarray(meta.offset, np.float64))
    return checker.tours_cost(xy, checker.split_subtours(route), bool(np.asarray(inst.is_open).reshape(-1)[0]),
                              convention=convention)


def _evaluate_vrplib(cfg: PolicyConfig, params, flags, batch_size: int, plan: ExecutionPlan) -> dict:
    files = sorted(glob.glob(os.path.join(flags.vrplib_dir, "*.vrp")) +
                   glob.glob(os.path.join(flags.vrplib_dir, "*.txt")))
    if not files:
        raise FileNotFoundError(f"no .vrp or Solomon .txt files in {flags.vrplib_dir}")
    bks = io.load_bks(flags.bks) if flags.bks else {}
    results, gaps = {}, []
    print(f"{'instance':14s} {'n':>4s} {'obj':>10s} {'BKS':>10s} {'gap %':>7s} {'time s':>7s}")
    for path in files[: flags.num_instances or None]:
        inst, meta = _read_benchmark_file(path)
        res = evaluation.evaluate_dataset(cfg, params, inst, pomo_size=flags.pomo_size,
                                          augment=flags.aug == 8, batch_size=1, seed=flags.seed,
                                          progress=False, desc=meta.name,
                                          chunk_size=getattr(flags, "chunk_size", None), plan=plan)
        best = bks.get(meta.name)
        if not res.solved[0]:
            results[meta.name] = {"n": meta.num_customers, "obj": None, "bks": best, "gap": None,
                                  "solved": False, "seconds": res.seconds, "compile_seconds": res.compile_seconds,
                                  "cost_convention": meta.cost_convention, **decoding_options(cfg, params)}
            print(f"{meta.name:14s} {meta.num_customers:4d} no solution found: every rollout ran into a dead end",
                  flush=True)
            continue
        obj = _original_cost(res.routes[0], inst, meta, meta.cost_convention)
        gap = None if best is None else (obj - best) / best * 100.0
        if gap is not None:
            gaps.append(gap)
        results[meta.name] = {"n": meta.num_customers, "obj": obj, "obj_unit_square": float(res.obj[0]),
                              "bks": best, "gap": gap, "solved": True, "route": res.routes[0],
                              "seconds": res.seconds,
                              "compile_seconds": res.compile_seconds,
                              "cost_convention": meta.cost_convention, **decoding_options(cfg, params)}
        print(f"{meta.name:14s} {meta.num_customers:4d} {obj:10.1f} {_fmt(best, '10.0f'):>10s} "
              f"{_fmt(gap, '7.2f'):>7s} {res.seconds:7.2f}", flush=True)
    if gaps:
        print(f"mean gap over {len(gaps)} instances with a BKS: {np.mean(gaps):.3f}%")
    return results
