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


# The fields of an instance tuple in file order (the route limit only with L, the last three only with TW).
FIELD_NAMES = ("depot", "node coordinates", "demands", "capacity", "route limit", "service times",
               "time window starts", "time window ends")
# What a field that should hold numbers holds instead, by numpy's dtype kind.
_NOT_NUMBERS = {"b": "booleans", "c": "complex numbers", "O": "objects (e.g. None or containers)", "U": "text",
                "S": "bytes", "M": "dates", "m": "time spans", "V": "raw records"}


def _numbers(values, what: str, path) -> np.ndarray:
    """One field of every instance as float64; a ValueError naming the file and the field for rows of
    different sizes, values that are not real numbers (text, booleans, objects) and NaN or infinities."""
    try:
        arr = np.asarray(values)
    except ValueError as e:       # rows of different lengths
        raise ValueError(f"{path}: the {what} of the instances have different sizes or are malformed ({e})") from None
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{path}: {_NOT_NUMBERS.get(arr.dtype.kind, arr.dtype)} where the {what} should be numbers")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{path}: non-finite values (NaN or infinity) in the {what}")
    return arr


def load_paper_instances(path: str | os.PathLike, variant: str | problems.Variant | None = None, *,
                         num_instances: int | None = None, offset: int = 0) -> Instance:
    """Read a paper instance file into a batched Instance (leading batch axis).

    ``variant`` defaults to the one named by the file name. ``num_instances`` keeps the first K
    instances after ``offset``. Raises ValueError naming the file for a file that is not such a pickle (or
    names a global outside ``safe_pickle``'s allow-list), instances with the wrong number of fields, fields
    whose shapes disagree, values that are not numbers (text, booleans, objects) and NaN or infinite values.
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
    names = [*FIELD_NAMES[:4], *(["route limit"] if var.limit else []), *(FIELD_NAMES[5:] if var.tw else [])]
    values = {name: _numbers(field, name, path) for name, field in zip(names, zip(*rows))}
    depot, nodes, demand = values["depot"], values["node coordinates"], values["demands"]
    if nodes.ndim != 3 or nodes.shape[-1] != 2 or demand.shape != nodes.shape[:2]:
        raise ValueError(f"{path}: node coordinates {nodes.shape} and demands {demand.shape} do not match")
    if depot.size != 2 * len(rows):
        raise ValueError(f"{path}: the depot must be one [x, y] per instance, got shape {depot.shape}")
    for name in names[3:]:      # one number per instance, or one per customer
        want = (len(rows),) if name in ("capacity", "route limit") else demand.shape
        if values[name].shape != want:
            raise ValueError(f"{path}: {name} of shape {values[name].shape}, expected {want}")
    kwargs = {}
    if var.limit:
        kwargs["route_limit"] = values["route limit"]
    if var.tw:
        kwargs.update(service_time=values["service times"], tw_start=values["time window starts"],
                      tw_end=values["time window ends"], depot_close=DEPOT_CLOSE)
    return from_arrays(depot, nodes, demand, values["capacity"], variant=var, **kwargs)


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


def save_paper_instances(path: str | os.PathLike, inst: Instance, capacity: float) -> None:
    """Write a batch of one variant's instances in the paper's instance format (the inverse of
    ``load_paper_instances``), demands as raw units of a vehicle of ``capacity``. A ValueError if the batch
    mixes variants or a demand is not a whole number of units. Read back, demands may differ from the batch's by float32
    rounding (the reader divides in float64)."""
    import pickle

    host = {k: np.asarray(v) for k, v in vars(inst).items()}
    flags = np.stack([host["is_open"], host["has_backhaul"], host["has_limit"], host["has_tw"]], -1)
    if not (flags == flags[0]).all():
        raise ValueError("save_paper_instances: the batch mixes variants; one file holds one variant")
    has_limit, has_tw = bool(flags[0, 2]), bool(flags[0, 3])
    raw = host["demand"][:, 1:].astype(np.float64) * capacity
    units = np.rint(raw)
    if np.abs(raw - units).max(initial=0.0) > 1e-3:
        raise ValueError(f"save_paper_instances: demands are not whole units of a capacity of {capacity:g}")
    rows = []
    for i in range(units.shape[0]):
        row = [host["locs"][i, :1].tolist(), host["locs"][i, 1:].tolist(), units[i].astype(int).tolist(),
               float(capacity)]
        if has_limit:
            row.append(float(host["route_limit"][i]))
        if has_tw:
            row += [host["service_time"][i, 1:].tolist(), host["tw_start"][i, 1:].tolist(),
                    host["tw_end"][i, 1:].tolist()]
        rows.append(tuple(row))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(rows, f, protocol=4)
