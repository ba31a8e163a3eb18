"""Reference solvers under exactly the environment's semantics (``docs/environment.md``).

* OR-Tools (``ortools``): all 16 variants under each backhaul rule (paper, classic, mixed); parallel
  cheapest insertion, then guided local search for a time limit per instance.
* PyVRP (``pyvrp``, hybrid genetic search): the 8 variants without backhauls, and the 8 with backhauls under
  the classic and mixed rules, whose semantics it expresses exactly.

Every returned route is replayed through ``mvmoe_jax.checker`` (``check=True``): an infeasible route or
a cost that differs from the checker's raises ``InfeasibleSolutionError``.

    from mvmoe_jax import io, baselines
    inst = io.load_paper_instances("vrpbltw50_uniform.pkl", num_instances=20)
    sols = baselines.solve(inst, solver="ortools", time_limit=20, workers=2)
    sols.costs, sols.routes            # float64 (K,), flat routes with 0 between sub-tours
    sols.save("ortools_vrpbltw50.pkl")  # the paper's solution format

Command line: ``python -m mvmoe_jax.baselines --solver=ortools --problem=VRPBLTW --data=FILE.pkl
--num_instances=K --time_limit=SECONDS --workers=2 --output=FILE.pkl``. Both solvers are dependencies
of the package.
"""

from __future__ import annotations

from mvmoe_jax import problems as _problems
from mvmoe_jax.baselines.common import (BaselineError, InfeasibleInstanceError, InfeasibleSolutionError,
                                        Problem, Solutions, SolveResult, SolverUnavailableError,
                                        UnknownSolverError, UnsupportedVariantError, problems_from_instances,
                                        route_cost, verify)

SOLVERS = ("ortools", "pyvrp")
DEFAULT_TIME_LIMIT = {"ortools": 20.0, "pyvrp": 5.0}


def _module(solver: str):
    name = str(solver).strip().lower().replace("-", "").replace("_", "")
    if name == "ortools":
        from mvmoe_jax.baselines import ortools_solver
        return ortools_solver
    if name == "pyvrp":
        from mvmoe_jax.baselines import pyvrp_solver
        return pyvrp_solver
    raise UnknownSolverError(f"unknown solver {solver!r}; expected one of: {', '.join(SOLVERS)}")


def canonical_solver(solver: str) -> str:
    return _module(solver).NAME


def supported_variants(solver: str, backhaul_rule: str | int = "paper") -> tuple[str, ...]:
    """Names of the variants ``solver`` models exactly under ``backhaul_rule`` (``problems.BACKHAUL_RULES``)."""
    name = canonical_solver(solver)
    rule = _problems.backhaul_rule_index(backhaul_rule)
    if name == "pyvrp" and rule == _problems.PAPER_RULE:
        return tuple(v.name for v in _problems.VARIANTS if not v.backhaul)
    return tuple(v.name for v in _problems.VARIANTS)


def check_supported(solver: str, variant, backhaul_rule: str | int = "paper") -> None:
    """Raise UnsupportedVariantError if ``solver`` cannot model ``variant`` under ``backhaul_rule`` exactly."""
    var = _problems.get_variant(variant)
    name = canonical_solver(solver)
    if var.name not in supported_variants(name, backhaul_rule):
        raise UnsupportedVariantError(
            f"{name} cannot express {var.name} exactly under the paper's backhaul rule (the vehicle leaves full "
            f"whatever it delivers); it supports {', '.join(supported_variants(name))} under it, and every "
            "variant under the classic and mixed rules. Use --solver=ortools for variants with B.")


def solve(instances, solver: str = "ortools", *, time_limit: float | None = None, workers: int = 1,
          progress: bool = True, check: bool = True, seed: int = 0) -> Solutions:
    """Solve a batched Instance (leading batch axis; variants may mix) with ``solver``.

    time_limit: seconds per instance (default 20 for OR-Tools, 5 for PyVRP); workers: parallel processes.
    Returns ``Solutions`` (costs under the environment's rule, flat routes, seconds per instance).
    """
    mod = _module(solver)
    limit = DEFAULT_TIME_LIMIT[mod.NAME] if time_limit is None else float(time_limit)
    kwargs = {"seed": seed} if mod.NAME == "pyvrp" else {}
    return mod.solve(instances, time_limit=limit, workers=workers, progress=progress, check=check, **kwargs)


__all__ = ["SOLVERS", "DEFAULT_TIME_LIMIT", "solve", "supported_variants", "check_supported",
           "canonical_solver", "Problem", "Solutions", "SolveResult", "problems_from_instances", "route_cost",
           "verify", "BaselineError", "UnknownSolverError", "UnsupportedVariantError", "SolverUnavailableError",
           "InfeasibleInstanceError", "InfeasibleSolutionError"]
