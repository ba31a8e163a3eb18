"""Solve instances with a trained policy and get routes back: the library form of ``python -m mvmoe_jax.solve``.

    from mvmoe_jax import solve
    report = solve.solve(["my_instances/", "X-n101-k25.vrp"], checkpoint="model.pt", search="sampling",
                         time_limit=5, output="solutions")
    for s in report.solutions:
        s.name, s.variant, s.cost, s.routes          # routes: lists of customers, the input's numbering

    solutions = solve.solve_instances(cfg, params, batch)   # a batched Instance already in memory

Instances are grouped by size and solved in batches; every route is replayed through the checker
(``mvmoe_jax.checker``) and nothing is written for a route that fails it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from mvmoe_jax import checker, precision
from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.instances import Instance, stack, take
from mvmoe_jax.nn.policy import PolicyConfig, distance_bias_of
from mvmoe_jax.solve import eas, outputs, sgbs
from mvmoe_jax.solve.inputs import Problem, Refused, read_inputs
from mvmoe_jax.solve.models import (Models, decoding_for, size_default_improve, size_default_max_starts,
                                    size_default_note,
                                   trained_size_of)
from mvmoe_jax.solve.search import SEARCHES, Decoder, Settings

SUMMARY_FILE = "summary.json"
IMPROVERS = ("none", "ls")   # what runs on the search's solution: nothing, or the local search (mvmoe_jax.local_search)
NO_SOLUTION = ("no solution found: every rollout reached a dead end, customers left that no move allowed by the "
               "instance's rules could serve")
COST_RTOL = 1e-4          # the file-unit cost and the checker's (float32, unit square) must agree this well


class NothingToSolveError(ValueError):
    """No input could be read; ``refused`` says why for each."""

    def __init__(self, message: str, refused: list[Refused]):
        super().__init__(message)
        self.refused = refused


@dataclasses.dataclass
class Solution:
    """One instance's solution.

      name, source, variant, num_customers: as read (``inputs.Problem``).
      backhaul_rule: the backhaul rule solved under (``problems.BACKHAUL_RULES``; ``paper`` without backhauls
                    unless stated).
      routes:       one list of customers per route, numbered as in the input (see ``outputs``).
      cost:         in the input's units under the environment's rules (exact Euclidean lengths; an open
                    route ends at its last customer).
      cost_convention, convention_cost: how the input's best-known costs count an edge
                    (``checker.COST_CONVENTIONS``: ``nint`` for CVRPLIB's EUC_2D files, ``dimacs`` for VRPLIB files
                    with time windows and Solomon files, else ``exact``) and the same routes' cost under it (the
                    ``.sol`` file's Cost).
      greedy_cost:  greedy x8's exact cost in the same units (the search started from it; cost <= greedy_cost).
      best_known, gap: a best-known cost and the gap to it in percent (from convention_cost; None when the
                    solution is not feasible), or None.
      found:        a rollout completed a solution (False where every start of every search ran into a dead end,
                    e.g. backhauls left under the classic rule with no linehaul to open their route: then ``routes``
                    is the incomplete attempt, ``cost`` its length and ``violation`` says so).
      feasible:     the checker replayed the routes: every rule kept, every customer served, the cost agreeing.
      violation:    the checker's finding when not feasible, else None.
      seconds:      the instance's share of its batch's search time (compilation excluded); greedy_seconds
                    greedy x8's part of it; compile_seconds its share of the compilation its batch waited for
                    (not counted in a time limit).
      starts:       POMO starts decoded; search, rounds (sampling rounds, EAS iterations, SGBS passes or
                    SGBS + EAS rounds run), model (the checkpoint).
      samples:      sampling: rollouts per start and copy in each round (fewer than asked where a round of
                    that many would not fit the time limit); the same seed, rounds and samples repeat the run.
                    Else None.
      depths:       SGBS and SGBS + EAS: the instance's beam-search depths over all passes (a pass runs until its
                    beam has finished, at most twice the customers; the time limit may stop the last part-way).
                    Else None.
      files:        what was written for it ({"sol": path, "plot": path}).
      improve:      the improvement run after the search (``IMPROVERS``: ``none`` or ``ls``, the local search);
                    improve_seconds its time (not in ``seconds``); searched_cost the search's cost before it.
      adapted:      EAS's adapted node embeddings, float32 (8, n + 1, D), one set per symmetric copy, when asked
                    for (``keep_adapted``); else None. Not in the JSON summary.
    """

    name: str
    source: str
    variant: str
    num_customers: int
    routes: list[list[int]]
    cost: float
    convention_cost: float
    greedy_cost: float
    best_known: float | None
    gap: float | None
    feasible: bool
    violation: str | None
    seconds: float
    starts: int
    search: str
    rounds: int
    model: str
    samples: int | None = None
    depths: int | None = None
    backhaul_rule: str = "paper"
    cost_convention: str = "exact"
    greedy_seconds: float = 0.0
    compile_seconds: float = 0.0
    improve: str = "none"
    improve_seconds: float = 0.0
    searched_cost: float | None = None
    found: bool = True
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    adapted: np.ndarray | None = dataclasses.field(default=None, repr=False)

    def to_json(self) -> dict:
        """The summary's entry; a route the checker refused is left out (``routes`` null), as from every file."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "adapted"}
        if not self.feasible:
            out["routes"] = None
        return out


@dataclasses.dataclass
class SolveReport:
    """A run: its solutions (input order), the inputs refused, and how it ran. ``plans``: per size and
    program, the decoding plan (starts and chunks, ``search.DecodePlan``); ``models``: the checkpoint used per
    size; seconds: the whole run's wall time; compile_seconds: compilation within it (search_seconds: the
    search's, which time limits count); warnings: one line each (a cost below a best-known value, a best-known
    value left out, a search that ran no round: ``outputs``); summary_file and
    adapted_file: what was written (``outputs.write_adapted``); decoding: per size (its key the number of
    customers as text), the model, the distance-aware decoding options it decoded with and the POMO starts it
    decoded at most ({"model": name, "distance_bias": alpha, "learned_distance_bias": whether the model learned
    alpha, "candidates": k, "max_starts": starts or None for all,
    "improve": the improvement after the search, "size_default": the options the size defaults chose};
    ``nn/locality.py``, ``models.decoding_for``, ``models.size_default_max_starts``,
    ``models.size_default_improve``). improve: the one given, else ``ls`` when a size default chose it for any."""

    solutions: list[Solution]
    refused: list[Refused]
    search: str
    settings: Settings
    seed: int
    models: dict[int, str]
    plans: dict[str, str]
    compile_seconds: float
    seconds: float
    summary_file: str | None = None
    adapted_file: str | None = None
    improve: str = "none"
    decoding: dict = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def search_seconds(self) -> float:
        return sum(s.seconds for s in self.solutions)

    def table(self) -> str:
        return outputs.table(self.solutions, self.search)

    def to_json(self) -> dict:
        return {"search": self.search, "improve": self.improve, "settings": dataclasses.asdict(self.settings), "seed": self.seed,
                "models": {str(n): m for n, m in self.models.items()}, "plans": self.plans,
                "device": str(jax.local_devices()[0].device_kind), "num_devices": len(jax.local_devices()),
                "seconds": self.seconds, "search_seconds": self.search_seconds,
                "compile_seconds": self.compile_seconds, "warnings": self.warnings,
                "adapted_file": self.adapted_file, "decoding": self.decoding,
                "instances": [s.to_json() for s in self.solutions],
                "refused": [dataclasses.asdict(r) for r in self.refused]}


def _groups(problems: Sequence[Problem], batch_size: int | None) -> list[list[int]]:
    """Indices of ``problems`` in batches of one size each (sizes in order of first appearance)."""
    by_size: dict[int, list[int]] = {}
    for i, p in enumerate(problems):
        by_size.setdefault(p.num_customers, []).append(i)
    out = []
    for n, idx in by_size.items():
        size = batch_size or max(1, min(64, 3200 // n))
        out.extend(idx[k:k + size] for k in range(0, len(idx), size))
    return out


def _solution(p: Problem, actions: np.ndarray, greedy_actions: np.ndarray, check: checker.RouteCheck,
              unit_cost: float, greedy_unit_cost: float, **fields) -> Solution:
    """The better of the searched and greedy routes by their cost in the input's units, checked. ``unit_cost``
    and ``greedy_unit_cost`` are the search's and greedy's costs in the unit square (+inf: nothing found)."""
    is_open = bool(p.instance.is_open)
    searched = checker.split_subtours(checker.actions_to_route(actions))
    greedy = checker.split_subtours(checker.actions_to_route(greedy_actions))
    cost, greedy_cost = (checker.tours_cost(p.coords, r, is_open) for r in (searched, greedy))
    violation = None if check.feasible else (
        check.violation if check.position is None
        else f"{check.violation} at position {check.position} (node {check.node})")
    if check.feasible and abs(check.cost - unit_cost) > COST_RTOL * max(check.cost, 1e-12):
        violation = f"cost {unit_cost:.7g} reported but the checker's is {check.cost:.7g}"
    elif check.feasible and abs(check.cost * p.scale - cost) > COST_RTOL * max(cost, 1e-12):
        violation = f"cost {cost:.7g} in the input's units but the checker's is {check.cost * p.scale:.7g}"
    found = bool(np.isfinite(unit_cost))
    if not found:
        violation = NO_SOLUTION
    if found and np.isfinite(greedy_unit_cost) and greedy_cost < cost:   # float rounding only: the search compared float32 costs
        searched, cost = greedy, greedy_cost
    stated = checker.tours_cost(p.coords, searched, is_open, convention=p.cost_convention)
    gap = None if p.best_known is None or violation else (stated - p.best_known) / p.best_known * 100.0
    return Solution(name=p.name, source=p.source, variant=p.variant, backhaul_rule=p.backhaul_rule,
                    num_customers=p.num_customers, routes=searched, cost=cost, cost_convention=p.cost_convention,
                    convention_cost=stated, greedy_cost=greedy_cost, best_known=p.best_known, gap=gap,
                    found=found, feasible=violation is None, violation=violation, **fields)


def solve_problems(problems: Sequence[Problem], model_for: Callable[[int], tuple[str, PolicyConfig, dict]], *,
                   search: str = "greedy", settings: Settings = Settings(), seed: int = 0,
                   batch_size: int | None = None, progress: bool = False,
                   on_solution: Callable[[Problem, Solution], None] | None = None,
                   execution: ExecutionPlan | None = None, keep_adapted: bool = False, improve: str = "none",
                   on_plan: Callable[[str, str], None] | None = None,
                   settings_for: Callable[[int], Settings] | None = None,
                   improve_for: Callable[[int], str] | None = None
                   ) -> tuple[list[Solution], dict[str, str], float]:
    """Solve ``problems`` (batches of one size; ``model_for(n)`` -> (name, config, params)). Returns (solutions
    in input order, decoding plans by size and program, compilation seconds). ``on_solution`` is called as
    each is found. ``execution``: the execution plan (None: the default backend's preset). ``keep_adapted``:
    each Solution keeps EAS's adapted embeddings (``search="eas"`` only). ``improve``: ``ls`` runs the local search
    on each searched solution (``IMPROVERS``). ``progress``: a bar over the instances that names each batch's stage
    (compiling, greedy, the search's rounds). ``on_plan(what, plan)`` is called with each new decoding plan.
    ``settings_for(n)``: the settings for instances of n customers (default ``settings`` for every size);
    ``improve_for(n)`` likewise the improvement (default ``improve``)."""
    if search not in SEARCHES:
        raise ValueError(f"unknown search {search!r}; choose one of {', '.join(SEARCHES)}")
    _check_improve(improve)
    if keep_adapted and search != "eas":
        raise ValueError(f"--save_adapted needs --search=eas: only EAS adapts parameters (search is {search!r})")
    out: list[Solution | None] = [None] * len(problems)
    plans, compile_s, decoders = {}, 0.0, {}
    base = jax.random.key(seed)
    bar = tqdm(total=len(problems), desc=search, unit="instance", disable=not progress, leave=False)
    groups = _groups(problems, batch_size)
    for b, idx in enumerate(groups):
        group = [problems[i] for i in idx]
        n = group[0].num_customers
        name, cfg, params = model_for(n)
        size_settings = settings if settings_for is None else settings_for(n)
        key = (name, cfg, size_settings)       # sizes decoded with other options (models.decoding_for) apart
        if key not in decoders:
            decoders[key] = Decoder(cfg, params, size_settings, execution)
        decoder = decoders[key]
        where = f"n={n}" + (f", batch {b + 1} of {len(groups)}" if len(groups) > 1 else "")
        decoder.on_stage = lambda stage, where=where: bar.set_postfix_str(f"{where}: {stage}")
        size = batch_size or max(1, min(64, 3200 // n))
        size = min(size, len([p for p in problems if p.num_customers == n]))
        batch = stack([p.instance for p in group] + [group[0].instance] * (size - len(group)))
        res = SEARCHES[search](decoder, batch, jax.random.fold_in(base, b), len(group))
        compile_s += res.compile_seconds
        for kind, plan in res.plans.items():
            what, described = f"n={n} {kind}", plan.describe()
            if on_plan is not None and plans.get(what) != described:
                on_plan(what, described)
            plans[what] = described
        real = take(batch, np.arange(len(group)))
        searched = [checker.actions_to_route(a) for a in res.actions[:len(group)]]
        routes, costs, improve_s = searched, [float(c) for c in res.cost[:len(group)]], [0.0] * len(group)
        size_improve = improve if improve_for is None else improve_for(n)
        if size_improve == "ls":
            decoder.on_stage("local search")
            routes, costs, improve_s = improve_routes(real, searched, costs)
        decoder.on_stage("checking and writing")
        checks = checker.check_routes(real, routes)
        for j, (i, p) in enumerate(zip(idx, group)):
            searched_cost = checker.tours_cost(p.coords, checker.split_subtours(searched[j]), bool(p.instance.is_open))
            out[i] = _solution(p, routes[j], res.greedy_actions[j], checks[j], costs[j], float(res.greedy_cost[j]),
                               improve=size_improve, improve_seconds=improve_s[j], searched_cost=searched_cost,
                               seconds=res.seconds / len(group), greedy_seconds=res.greedy_seconds / len(group),
                               compile_seconds=res.compile_seconds / len(group), starts=res.plans["greedy"].starts, search=search,
                               rounds=res.rounds, model=name, samples=res.samples,
                               depths=None if res.depths is None else int(res.depths[j]),
                               adapted=res.adapted[j] if keep_adapted and res.adapted is not None else None)
            if on_solution is not None:
                on_solution(p, out[i])
        bar.update(len(group))
    bar.close()
    return out, plans, compile_s


def _check_improve(improve: str) -> None:
    if improve not in IMPROVERS:
        raise ValueError(f"unknown improvement {improve!r}; choose one of {', '.join(IMPROVERS)}")


def improve_routes(instances: Instance, routes: list[list[int]], costs: list[float], time_limit: float | None = None):
    """The local search (at most ``time_limit`` seconds each) on each instance's flat route (a batched Instance):
    (flat routes, costs in the unit square, seconds each). A route the environment refuses (a search that found
    no complete solution) is left as it is with its cost, for the checker to report."""
    from mvmoe_jax import local_search

    out, out_costs, seconds = [], [], []
    for j, route in enumerate(routes):
        t0 = time.perf_counter()
        try:
            found = local_search.improve_instance(jax.tree.map(lambda x: x[j], instances), checker.split_subtours(route),
                                                  time_limit=time_limit)
        except local_search.StartInfeasibleError:
            out.append(route)
            out_costs.append(costs[j])
        else:
            out.append([v for t in found.routes for v in (*t, 0)][:-1])
            out_costs.append(found.cost)
        seconds.append(time.perf_counter() - t0)
    return out, out_costs, seconds


def _write(output: str | None, plot: bool):
    """The ``on_solution`` that writes a feasible solution's ``.sol`` (and PNG) into ``output``."""
    def write(p: Problem, s: Solution) -> None:
        if output is None or not s.feasible:
            return
        s.files["sol"] = outputs.write_sol(os.path.join(output, f"{p.name}.sol"), s.routes, s.convention_cost,
                                           convention=s.cost_convention, open_routes=bool(p.instance.is_open))
        if plot:
            from mvmoe_jax.solve.plot import plot_solution
            s.files["plot"] = plot_solution(os.path.join(output, f"{p.name}.png"), p, s)
    return write


def check_output_folder(output: str | None) -> None:
    """A ValueError naming ``--output`` when it cannot be the folder of the results: an existing file, or a
    path below one."""
    if output is None:
        return
    path = os.path.abspath(output)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        where = "is a file" if path == os.path.abspath(output) else f"is below the file {path}"
        raise ValueError(f"--output {output} {where}; give a folder for the .sol files and {SUMMARY_FILE}")


def _model_lines(decoding: dict[str, dict]) -> list[str]:
    """One line per size: the checkpoint that solves it and the decoding options it decodes with (saying which
    the size default chose)."""
    lines = []
    for size, d in decoding.items():
        options = [f"{k} {d[k]:g}" + (f" ({size_default_note(k)})" if k in d["size_default"] else
                                      " (learned)" if k == "distance_bias" and d.get("learned_distance_bias") else "")
                   for k in ("distance_bias", "candidates", "max_starts") if d.get(k)]
        line = f"n = {size}: model {d['model']}" + (", decoding with " + ", ".join(options) if options else "")
        if d.get("improve") == "ls":
            line += ", then the local search" + (f" ({size_default_note('improve')})"
                                                 if "improve" in d["size_default"] else "")
        lines.append(line)
    return lines


def solve(inputs, *, checkpoint: str | None = None, search: str = "greedy", time_limit: float | None = None,
          rounds: int | None = None, samples: int = 8, max_starts: int | None = None, seed: int = 0,
          problem: str | None = None, num_instances: int | None = None, bks: str | None = None,
          backhauls: str | None = None,
          batch_size: int | None = None, output: str | None = None, plot: bool = False, progress: bool = False,
          memory_budget: int | None = None, execution: ExecutionPlan | None = None,
          eas_learning_rate: float = eas.LEARNING_RATE, eas_imitation_weight: float = eas.IMITATION_WEIGHT,
          save_adapted: str | None = None, improve: str | None = None, beam_width: int = sgbs.BEAM_WIDTH,
          expansion: int = sgbs.EXPANSION, distance_bias: float | None = None,
          candidates: int | None = None, log: Callable[[str], None] | None = None) -> SolveReport:
    """Solve every instance in ``inputs`` (a file or folder, or a list of them; formats in ``inputs.FORMATS``).

    checkpoint: a shipped model's name or a checkpoint path (``checkpoints.load_policy``); None: per size, the
    shipped model trained closest to it. search: a name in ``search.SEARCHES``; time_limit, rounds, samples,
    max_starts, memory_budget, eas_learning_rate, eas_imitation_weight, beam_width, expansion: ``search.Settings``. save_adapted: with
    ``search="eas"``, a file for the adapted embeddings of every instance (``outputs.write_adapted``). problem: the
    variant, when the data does not say it all (``inputs.state_variant``). num_instances: at most this many from
    each file of several. bks: a table of best-known values (BKS.json style). backhauls: the backhaul rule
    (``paper``, ``classic``, ``mixed``) for every instance, overriding what the files state (VRPLIB files with
    backhauls are classic, the paper's data paper, JSON files say). output: a folder for a ``.sol`` per
    instance (and with ``plot`` a PNG) and ``summary.json``; None writes nothing. execution: the execution plan
    (None: the default backend's preset; results do not depend on it). distance_bias, candidates: the
    distance-aware decoding options (``PolicyConfig`` fields, ``nn/locality.py``; 0: off) for every model;
    None: each model's own, and for a model without any, the size default (``models.decoding_for``: the
    distance bias on instances of at least twice a shipped model's training size). improve: ``none`` or ``ls``
    (the local search after the search) for every instance; None: the size default (``models.size_default_improve``:
    ``ls`` from twice a shipped model's training size). log: called with a line as soon as it is known (the model
    for each size, decoding options, each program's decoding plan), before the solving it describes ends.

    Inputs that cannot be read are refused (``report.refused``) and the rest solved; NothingToSolveError when
    none is left; CheckpointRequiredError (a ValueError) when no checkpoint is given and none ships.
    """
    t_start = time.perf_counter()
    if search not in SEARCHES:
        raise ValueError(f"unknown search {search!r}; choose one of {', '.join(SEARCHES)}")
    if num_instances is not None and num_instances < 1:
        raise ValueError(f"--num_instances must be a positive integer, got {num_instances}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"--batch_size must be a positive integer, got {batch_size}")
    if save_adapted is not None and search != "eas":
        raise ValueError(f"--save_adapted needs --search=eas: only EAS adapts parameters (search is {search!r})")
    if improve is not None:
        _check_improve(improve)
    check_output_folder(output)
    log = log or (lambda line: None)
    settings = Settings(time_limit=time_limit, rounds=rounds, samples=samples, max_starts=max_starts,
                        memory_budget=memory_budget, eas_learning_rate=eas_learning_rate,
                        eas_imitation_weight=eas_imitation_weight, beam_width=beam_width, expansion=expansion)
    paths = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not paths:
        raise ValueError("no input given: name files or folders of instances")
    problems, refused = read_inputs(paths, problem=problem, num_instances=num_instances, bks=bks, backhauls=backhauls)
    if not problems:
        raise NothingToSolveError("no instance could be read: " + "; ".join(r.error for r in refused[:5])
                                  + (f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""), refused)
    models = Models(checkpoint)
    names = {p.num_customers: models.name_for(p.num_customers) for p in problems}
    for name in dict.fromkeys(names.values()):
        models.load(name)                     # every checkpoint read before anything is solved or written

    given = {k: v for k, v in (("distance_bias", distance_bias), ("candidates", candidates)) if v is not None}
    # Per size: the model's config with the decoding options (given, the model's own, or the size default). Bad
    # values are refused here, before anything is solved or written.
    configs, sized, improvements, decoding = {}, {}, {}, {}
    for n, name in names.items():
        trained = trained_size_of(name)
        configs[n], by_size = decoding_for(models.load(name)[0], trained, n, given)
        sized[n] = settings
        default_starts = size_default_max_starts(n)
        if max_starts is None and default_starts is not None:
            sized[n] = dataclasses.replace(settings, max_starts=default_starts)
            by_size = by_size + ["max_starts"]
        improvements[n] = improve if improve is not None else size_default_improve(trained, n)
        if improve is None and improvements[n] != "none":
            by_size = by_size + ["improve"]
        decoding[str(n)] = {"model": name, "distance_bias": distance_bias_of(configs[n], models.load(name)[1]),
                            "learned_distance_bias": configs[n].learned_distance_bias,
                            "candidates": configs[n].candidates, "max_starts": sized[n].max_starts,
                            "improve": improvements[n], "size_default": by_size}

    def model_for(n):
        return names[n], configs[n], models.load(names[n])[1]

    for line in _model_lines(decoding):
        log(line)
    if output is not None:
        os.makedirs(output, exist_ok=True)
    with precision.matmul_precision(precision.EVAL_DEFAULT):
        solutions, plans, compile_s = solve_problems(problems, model_for, search=search, settings=settings,
                                                     settings_for=sized.__getitem__, seed=seed,
                                                     batch_size=batch_size, progress=progress,
                                                     on_solution=_write(output, plot), execution=execution,
                                                     keep_adapted=save_adapted is not None,
                                                     improve_for=improvements.__getitem__,
                                                     on_plan=lambda what, plan: log(f"{what}: {plan}"))
    warnings = [f"{p.name}: {note}" for p in problems for note in p.notes]
    warnings += outputs.below_best_known_warnings(solutions)
    warnings += outputs.idle_search_warning(solutions, search, time_limit, compile_s)
    ran = improve if improve is not None else ("ls" if "ls" in improvements.values() else "none")
    report = SolveReport(solutions=solutions, refused=refused, search=search, settings=settings, seed=seed,
                         improve=ran, models=names, plans=plans, compile_seconds=compile_s, seconds=0.0,
                         decoding=decoding, warnings=warnings)
    if save_adapted is not None:
        report.adapted_file = outputs.write_adapted(save_adapted, solutions)
    report.seconds = time.perf_counter() - t_start
    if output is not None:
        report.summary_file = outputs.write_summary(os.path.join(output, SUMMARY_FILE), report.to_json())
    return report


def solve_instances(cfg: PolicyConfig, params, batch: Instance, *, search: str = "greedy", seed: int = 0,
                    batch_size: int | None = None, keep_adapted: bool = False, improve: str = "none",
                    **settings) -> list[Solution]:
    """Solve a batched Instance already in memory (B instances, unit square) with the policy (cfg, params):
    one Solution per instance, costs in the Instance's units. ``settings``: ``search.Settings`` fields.
    ``keep_adapted``: with ``search="eas"``, each Solution's ``adapted`` holds its adapted embeddings. ``improve``:
    ``ls`` runs the local search on each searched solution."""
    k = int(batch.locs.shape[0])
    problems = [Problem(name=f"instance-{i}", source=f"<batch>#{i}", instance=jax.tree.map(lambda x: x[i], batch),
                        coords=np.asarray(batch.locs[i], np.float64)) for i in range(k)]
    checker.validate_instances(batch, "batch")
    with precision.matmul_precision(precision.EVAL_DEFAULT):
        solutions, _, _ = solve_problems(problems, lambda n: ("<given>", cfg, params), search=search,
                                         settings=Settings(**settings), seed=seed, batch_size=batch_size,
                                         keep_adapted=keep_adapted, improve=improve)
    return solutions
