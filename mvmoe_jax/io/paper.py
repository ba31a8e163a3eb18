"""The MVMoE paper's instance and solution pickles (formats in shared/data/mvmoe-paper/README.md).

Instance file: a list of tuples, one per instance, whose length depends on the variant:
  4 fields  (depot_xy [[x, y]], node_xy [[x, y]]*n, demand [d]*n, capacity)        C, O, B combinations
  5 fields  + route_limit                                                          with L, no TW
  7 fields  + service_time [s]*n, tw_start [e]*n, tw_end [l]*n                     with TW, no L
  8 fields  + route_limit, service_time, tw_start, tw_end                          with L and TW
Solution file: a list of (cost, route) per instance, route a flat list of nodes, 0 between sub-tours.
"""

from __future__ import annotations

import os
import re

import numpy as np

from mvmoe_jax import problems
from mvmoe_jax.instances import DEPOT_CLOSE, Instance, from_arrays
from mvmoe_jax.io import safe_pickle

_FILE_RE = re.compile(r"^([a-z]+?)(\d+)_uniform\.pkl$")


def expected_fields(variant: problems.Variant) -> int:
    return 4 + (1 if variant.limit else 0) + (3 if variant.tw else 0)


def variant_from_filename(path: str | os.PathLike) -> problems.Variant:
    """``.../vrpbltw50_uniform.pkl`` -> VRPBLTW (raises for names that do not follow the paper's)."""
    m = _FILE_RE.match(os.path.basename(os.fspath(path)))
    if not m:
        raise ValueError(f"cannot tell the variant from file name {os.fspath(path)!r}; pass it explicitly")
    return problems.get_variant(m.group(1))


def load_paper_instances(path: str | os.PathLike, variant: str | problems.Variant | None = None, *,
                         num_instances: int | None = None, offset: int = 0) -> Instance:
    """Read a paper instance file into a batched Instance (leading batch axis).

    ``variant`` defaults to the one named by the file name. ``num_instances`` keeps the first K
    instances after ``offset``.
    """
    var = variant_from_filename(path) if variant is None else problems.get_variant(variant)
    data = safe_pickle.load(path)
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError(f"{path}: expected a non-empty list of instances, got {type(data).__name__}")
    stop = None if num_instances is None else offset + num_instances
    rows = data[offset:stop]
    if not rows:
        raise ValueError(f"{path}: no instances in range offset={offset}, num_instances={num_instances} "
                         f"(file has {len(data)})")
    want = expected_fields(var)
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or len(row) != want:
            got = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
            raise ValueError(
                f"{path}: instance {offset + i} has {got} fields, but a {var.name} instance has {want} "
                "(4: C/O/B, 5: +L, 7: +TW, 8: +L+TW); is the variant right?")
    fields = list(zip(*rows))
    try:
        depot = np.asarray(fields[0], np.float64).reshape(len(rows), 2)
        nodes = np.asarray(fields[1], np.float64)
        demand = np.asarray(fields[2], np.float64)
        capacity = np.asarray(fields[3], np.float64).reshape(len(rows))
        rest = [np.asarray(f, np.float64) for f in fields[4:]]
    except ValueError as e:
        raise ValueError(f"{path}: instances of different sizes or malformed fields ({e})") from None
    if nodes.ndim != 3 or nodes.shape[-1] != 2 or demand.shape != nodes.shape[:2]:
        raise ValueError(f"{path}: node coordinates {nodes.shape} and demands {demand.shape} do not match")
    if not (np.all(np.isfinite(nodes)) and np.all(np.isfinite(demand))):
        raise ValueError(f"{path}: non-finite coordinates or demands")
    kwargs = {}
    if var.limit:
        kwargs["route_limit"] = rest.pop(0).reshape(len(rows))
    if var.tw:
        kwargs.update(service_time=rest[0], tw_start=rest[1], tw_end=rest[2], depot_close=DEPOT_CLOSE)
    return from_arrays(depot, nodes, demand, capacity, variant=var, **kwargs)


def load_paper_solutions(path: str | os.PathLike, *, num_instances: int | None = None,
                         offset: int = 0) -> tuple[np.ndarray, list[list[int]]]:
    """Read a solution file: (costs float64 (K,), routes [flat node list with 0 between sub-tours])."""
    data = safe_pickle.load(path)
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"{path}: expected a list of (cost, route) pairs, got {type(data).__name__}")
    stop = None if num_instances is None else offset + num_instances
    costs, routes = [], []
    for i, item in enumerate(data[offset:stop]):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"{path}: entry {offset + i} is not a (cost, route) pair")
        cost, route = item
        try:
            costs.append(float(cost))
            routes.append([int(v) for v in route])
        except (TypeError, ValueError):
            raise ValueError(f"{path}: entry {offset + i} has a malformed cost or route") from None
    return np.asarray(costs, np.float64), routes


def save_paper_solutions(path: str | os.PathLike, costs, routes) -> None:
    """Write (cost, route) pairs in the paper's solution format (plain floats and int lists)."""
    import pickle

    pairs = [(float(c), [int(v) for v in r]) for c, r in zip(costs, routes)]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(pairs, f, protocol=4)


def dataset_path(data_dir: str | os.PathLike, variant, size: int) -> str:
    """``DIR/<VARIANT>/<variant><size>_uniform.pkl`` (the paper's layout)."""
    var = problems.get_variant(variant)
    return os.path.join(os.fspath(data_dir), var.name, f"{var.lower}{size}_uniform.pkl")


def reference_solver(variant, size: int) -> str:
    """The solver file prefix the paper computes gaps against for this variant and size."""
    var = problems.get_variant(variant)
    if var.name in ("CVRP", "VRPTW"):
        return "hgs"
    if var.name in ("OVRP", "VRPL") and size == 100:
        return "lkh"
    return "or_tools_200s" if size <= 50 else "or_tools_400s"


def reference_solution_path(data_dir, variant, size: int, solver: str | None = None) -> str:
    var = problems.get_variant(variant)
    solver = reference_solver(var, size) if solver is None else solver
    return os.path.join(os.fspath(data_dir), var.name, f"{solver}_{var.lower}{size}_uniform.pkl")
