"""VRPLIB instances (CVRPLIB's Set X, and the sections PyVRP reads for the other variants) and the paper's
best-known-solution table.

``read_vrplib`` turns one ``.vrp`` file into a batch-of-one ``Instance`` in the unit square that the
models were trained on, plus a ``VrplibMeta`` that maps costs back to the file's units::

    inst, meta = read_vrplib(".../CVRP-LIB/X-n101-k25.vrp")
    original_cost = unit_square_cost * meta.scale

Parsing is left to the ``vrplib`` package; this module validates what it returns, because ``vrplib``
accepts much that a CVRP solver cannot use (string coordinates, several depots, missing sections).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import jax
import numpy as np

from mvmoe_jax import checker, problems
from mvmoe_jax.instances import DEPOT_CLOSE, ROUTE_LIMIT, Instance, from_arrays


class DataFileNotFoundError(FileNotFoundError, ValueError):
    """A data file does not exist.

    Both a ``FileNotFoundError`` (what callers of file readers expect) and a ``ValueError`` (what the
    readers of this package raise for every unusable input), so either ``except`` clause catches it.
    """


def require_file(path: str | os.PathLike) -> str:
    """``os.fspath(path)``, or a DataFileNotFoundError naming the path when it is not a file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataFileNotFoundError(f"{path}: no such file")
    return path


# ----------------------------------------------------------------------------------------------------
# Unit-square scaling, shared with the Solomon reader
# ----------------------------------------------------------------------------------------------------

def read_json(path: str) -> Any:
    """The JSON value in the file at ``path`` (after ``require_file``); a ValueError naming it otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a usable JSON file (nested too deeply to read)") from None


def unit_square_transform(xy: np.ndarray, *, source: str, loc_scale: float | None = None,
                          depot_close: float | None = None,
                          route_limit: float | None = None) -> tuple[np.ndarray, float]:
    """Offset and scale that map coordinates ``xy`` (N, 2) into [0, 1]^2 with distances scaled uniformly.

    Default (``loc_scale=None``): offset = the per-axis minimum over all nodes, scale = the largest
    extent over both axes, so the instance touches 0 and 1 along its longer axis. One factor for both
    axes keeps every distance proportional to the original one (``original = unit * scale``).

    Times and route limits are divided by the same scale, so a ``depot_close`` or ``route_limit`` (file
    units) raises the scale to at least ``depot_close / 3`` and ``route_limit / 3``: the horizon then
    stays within the training data's (depot closing at 3, route limit 3), where the policy has learnt to
    read times. A longer horizon leaves the nodes in a smaller corner of the square instead.

    ``loc_scale`` fixes the scale instead and uses offset (0, 0), i.e. ``xy / loc_scale`` (the reference
    implementation solves Set X with ``loc_scale=1000``); the coordinates must then already lie in
    [0, loc_scale]. Returns (offset float64 (2,), scale float).
    """
    xy = np.asarray(xy, np.float64)
    if loc_scale is not None:
        if not (loc_scale > 0 and math.isfinite(loc_scale)):
            raise ValueError(f"{source}: loc_scale must be a positive number, got {loc_scale!r}")
        if xy.min() < 0 or xy.max() > loc_scale:
            raise ValueError(f"{source}: coordinates span [{xy.min():g}, {xy.max():g}], outside "
                             f"[0, loc_scale={loc_scale:g}]; they would leave the unit square")
        return np.zeros(2), float(loc_scale)
    offset = xy.min(axis=0)
    scale = float((xy.max(axis=0) - offset).max())
    if not scale > 0:
        raise ValueError(f"{source}: all nodes share one location, so there is nothing to scale")
    return offset, max(scale, horizon_scale(depot_close, route_limit))


def horizon_scale(depot_close: float | None = None, route_limit: float | None = None) -> float:
    """The smallest scale that maps a depot closing time and a route limit (file units, None for absent)
    to no more than the training data's: ``max(depot_close / DEPOT_CLOSE, route_limit / ROUTE_LIMIT)``,
    0 without either."""
    bounds = [value / bound for value, bound in ((depot_close, DEPOT_CLOSE), (route_limit, ROUTE_LIMIT))
              if value is not None]
    return float(max(bounds, default=0.0))


def to_unit_square(xy: np.ndarray, offset: np.ndarray, scale: float) -> np.ndarray:
    """(N, 2) -> (N, 2) in [0, 1]^2; clipped so float rounding cannot put a node at 1 + 1e-16."""
    return np.clip((np.asarray(xy, np.float64) - offset) / scale, 0.0, 1.0)


# ----------------------------------------------------------------------------------------------------
# VRPLIB reader
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VrplibMeta:
    """What ``read_vrplib`` knows about the file beyond the normalised Instance.

      name:          the instance's NAME (e.g. ``X-n101-k25``).
      num_customers: n (DIMENSION - 1).
      capacity:      the raw vehicle capacity (demands in the Instance are divided by it).
      scale:         multiply a unit-square cost (or time, or route length) by this to get the file's units.
      offset:        (x, y) subtracted from the raw coordinates before dividing by ``scale``.
      cost_convention: how the file's best-known costs count an edge (``checker.COST_CONVENTIONS``): ``nint``
                     (every edge rounded to the nearest integer, CVRPLIB's EUC_2D objective) or, for a file with
                     time windows, ``dimacs`` (every edge truncated to one decimal, how CVRPLIB states the
                     Solomon and Gehring-Homberger VRPTW best-known values). Costs computed on the Instance
                     are exact Euclidean lengths, ``unit_cost * scale`` in file units; ``checker.tours_cost``
                     with this convention gives the cost comparable with a best-known value.
      variant:       the variant read off the file (see ``read_vrplib``), e.g. ``CVRP`` or ``OVRPBLTW``.
      backhaul_rule: the backhaul rule the instance is read under (``problems.BACKHAUL_RULES``): ``classic``
                     for a file with backhauls (VRPLIB's VRPB), unless stated otherwise; ``paper`` without.
      num_vehicles:  the file's VEHICLES, if given (not enforced: the environment has no fleet limit).
      coords:        float64 (n+1, 2): the file's coordinates, depot first (for costs in its units).
    """

    name: str
    num_customers: int
    capacity: float
    scale: float
    offset: tuple[float, float]
    cost_convention: str = "nint"
    variant: str = "CVRP"
    backhaul_rule: str = "paper"
    num_vehicles: int | None = None
    coords: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def original_cost(self, unit_cost):
        """Unit-square cost(s) -> (unrounded) cost in the file's units."""
        return np.asarray(unit_cost, np.float64) * self.scale


# The VRPLIB fields this reader understands, lower case as ``vrplib`` names them: the specifications and the
# data sections (``<NAME>_SECTION``) that PyVRP's reader (pyvrp.read, 0.12) takes for these variants, and
# CVRPLIB's DISTANCE. Anything else is refused by name rather than silently ignored.
SPECIFICATIONS = ("name", "comment", "type", "dimension", "edge_weight_type", "capacity", "vehicles",
                  "service_time", "distance", "vehicles_max_distance", "vehicles_max_duration")
SECTIONS = ("node_coord", "demand", "linehaul", "backhaul", "time_window", "service_time", "depot",
            "vehicles_max_distance", "vehicles_max_duration")
_TYPE_ALIASES = {"CVRPTW": "VRPTW", "VRP": "CVRP"}


def _numeric(arr, *, source: str, what: str) -> np.ndarray:
    """vrplib hands back string arrays when a section has non-numeric entries; refuse them clearly."""
    try:
        out = np.asarray(arr, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {what} contains non-numeric entries") from None
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{source}: {what} contains non-finite entries")
    return out


def _parse_vrplib(path: str) -> dict:
    import vrplib   # imported here: the rest of the package does not need it

    try:
        # Edge weights are not needed (we recompute Euclidean distances) and cost O(n^2) memory.
        return vrplib.read_instance(path, compute_edge_weights=False)
    except Exception as e:   # vrplib raises RuntimeError / ValueError / IndexError for malformed text
        raise ValueError(f"{path}: not a readable VRPLIB file ({type(e).__name__}: {e})") from None


def _field_names(path: str) -> tuple[list[str], list[str]]:
    """(specification keys, section names) of a VRPLIB file, upper case as written."""
    specs, sections = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            head = line.strip()
            m = re.match(r"^([A-Za-z0-9_]+)_SECTION\b", head, re.IGNORECASE)
            if m:
                sections.append(m.group(1).upper())
            elif ":" in head:
                specs.append(head.split(":", 1)[0].strip().upper())
    return specs, sections


def _check_fields(path: str) -> None:
    specs, sections = _field_names(path)
    unknown = [s for s in specs if s.lower() not in SPECIFICATIONS]
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {', '.join(unknown[:5])}; this reader understands "
                         f"{', '.join(s.upper() for s in SPECIFICATIONS)}")
    unknown = [s for s in sections if s.lower() not in SECTIONS]
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {', '.join(s + '_SECTION' for s in unknown[:5])}; this "
                         f"reader understands {', '.join(s.upper() + '_SECTION' for s in SECTIONS)}")


def _check_edge_weight_type(data: dict, path: str) -> None:
    """Only EUC_2D: a ValueError naming the file's EDGE_WEIGHT_TYPE (and its EDGE_WEIGHT_FORMAT) otherwise."""
    ewt = str(data.get("edge_weight_type", "")).strip().upper()
    if ewt == "EUC_2D":
        return
    found = f"is {ewt!r}" if ewt else "is missing"
    fmt = str(data.get("edge_weight_format", "")).strip().upper()
    given = f" (EDGE_WEIGHT_FORMAT {fmt}: distances given, not coordinates)" if ewt == "EXPLICIT" and fmt else ""
    raise ValueError(f"{path}: EDGE_WEIGHT_TYPE {found}{given}; only EUC_2D (Euclidean coordinates) is supported")


def _stated_type(data: dict, path: str) -> problems.Variant | None:
    """The variant TYPE names (None without TYPE); a TYPE that is not one of the 16 is refused."""
    if "type" not in data:
        return None
    name = str(data["type"]).strip().upper()
    try:
        return problems.get_variant(_TYPE_ALIASES.get(name, name))
    except problems.UnknownVariantError:
        raise ValueError(f"{path}: TYPE {name!r} is not one of the 16 variants this solver knows "
                         f"({', '.join(problems.VARIANT_NAMES)})") from None


def _per_node(data: dict, key: str, n_nodes: int, path: str, label: str) -> np.ndarray | None:
    """A section of one number per node (or a specification: the same number for every customer, 0 for the
    depot, as PyVRP reads SERVICE_TIME), float64 (n_nodes,); None when absent."""
    if key not in data:
        return None
    value = _numeric(data[key], source=path, what=label)
    if value.ndim == 0:
        return np.r_[0.0, np.full(n_nodes - 1, float(value))]
    if value.shape != (n_nodes,):
        raise ValueError(f"{path}: {label} has {value.size} entries for {n_nodes} nodes")
    return value


def _route_limit(data: dict, path: str, has_time: bool) -> float | None:
    """The one route-length limit given by DISTANCE, VEHICLES_MAX_DISTANCE or (where no clock runs, so that a
    route's duration is its length) VEHICLES_MAX_DURATION; None when none is."""
    found = {}
    for key, label in (("distance", "DISTANCE"), ("vehicles_max_distance", "VEHICLES_MAX_DISTANCE"),
                       ("vehicles_max_duration", "VEHICLES_MAX_DURATION")):
        if key not in data:
            continue
        values = np.unique(_numeric(data[key], source=path, what=label).reshape(-1))
        if values.size != 1:
            raise ValueError(f"{path}: {label} differs between vehicles ({values[:5].tolist()}); the "
                             "environment has one route limit for every vehicle")
        found[label] = float(values[0])
    if "VEHICLES_MAX_DURATION" in found and has_time:
        raise ValueError(f"{path}: VEHICLES_MAX_DURATION with time windows or service times limits a route's "
                         "duration (waiting and service included), which the environment cannot express; its "
                         "route limit bounds the distance (use VEHICLES_MAX_DISTANCE)")
    if len(set(found.values())) > 1:
        raise ValueError(f"{path}: the route limits disagree: " + ", ".join(f"{k} {v:g}" for k, v in found.items()))
    if not found:
        return None
    limit = next(iter(found.values()))
    if not limit > 0:
        raise ValueError(f"{path}: the route limit must be positive, got {limit:g}")
    return limit


def read_vrplib(path: str | os.PathLike, *, loc_scale: float | None = None,
                backhaul_rule: str | None = None) -> tuple[Instance, VrplibMeta]:
    """Read a VRPLIB ``.vrp`` file (EUC_2D, one depot at node 1) as a batch-of-one Instance.

    Besides CVRPLIB's sections, the file may hold those PyVRP's reader takes for the other variants, so the
    same file solves in both (the rules applied are this environment's, docs/environment.md):

      TIME_WINDOW_SECTION     ``node early late``; the depot's row gives its closing time (it must open at
                              0). With it the variant has time windows (TW).
      SERVICE_TIME_SECTION    ``node duration`` (or the specification SERVICE_TIME: one duration for every
                              customer); only with time windows.
      LINEHAUL_SECTION        deliveries, in place of DEMAND_SECTION; BACKHAUL_SECTION: pickups (B). A
                              customer either delivers or picks up, never both. Backhauls follow the classic
                              rule of VRPLIB's VRPB (docs/environment.md): on a route every linehaul comes
                              before any backhaul, a route starts with a linehaul, deliveries and pickups each
                              fit the capacity. ``backhaul_rule`` states another (``paper``, ``mixed``). (PyVRP
                              applies that order only to TYPE VRPB; for other types it lets pickups and
                              deliveries mix, the ``mixed`` rule.)
      DISTANCE, VEHICLES_MAX_DISTANCE   the route-length limit (L), one value for every vehicle; also
                              VEHICLES_MAX_DURATION where no time windows or service times make a route's
                              duration differ from its length.
      TYPE                    a variant name (CVRP, VRPTW, OVRPBLTW, ...). An open one (O...) makes routes
                              open (PyVRP has no field for that and ignores TYPE, so it reads the file as
                              closed); a TYPE naming an attribute whose data is missing is refused.
      VEHICLES, COMMENT       accepted; the fleet size is not enforced.

    The variant is read off the data: TW with time windows, B with pickups, L with a route limit, O from
    TYPE. Returns (Instance with locs (1, n+1, 2) in [0, 1]^2, demand (1, n+1) = raw / capacity, pickups
    negative, times and the route limit divided by the same factor as the coordinates, meta). Coordinates
    are scaled as described in ``unit_square_transform`` (``loc_scale`` as there). Costs on the Instance are
    exact Euclidean lengths; ``meta.scale`` converts them to file units, still exact (CVRPLIB's own
    objective rounds or truncates each edge: see ``VrplibMeta.cost_convention``).

    Raises ValueError (naming the file) for a missing, empty or unreadable file, an unknown field or section,
    an edge weight type other than EUC_2D, a missing CAPACITY / NODE_COORD / DEMAND / DEPOT section, text or
    NaN or infinities where numbers belong, a depot other than node 1 alone, a nonzero depot demand, negative
    demands, demands or pickups above capacity, counts that disagree with DIMENSION, a window closing before it
    opens, and a customer no route can serve (a window closing before a vehicle can arrive, a route limit
    shorter than its round trip, ...).
    """
    path = require_file(path)
    data = _parse_vrplib(path)
    if not data:
        raise ValueError(f"{path}: empty file (no VRPLIB specification or section)")
    _check_edge_weight_type(data, path)     # first: an EXPLICIT file's other fields follow from its type
    _check_fields(path)
    for keys, label in ((("capacity",), "CAPACITY"), (("node_coord",), "NODE_COORD_SECTION"),
                        (("demand", "linehaul"), "DEMAND_SECTION (or LINEHAUL_SECTION)"),
                        (("depot",), "DEPOT_SECTION")):
        if not any(k in data for k in keys):
            raise ValueError(f"{path}: missing {label}")
    if "demand" in data and "linehaul" in data:
        raise ValueError(f"{path}: both DEMAND_SECTION and LINEHAUL_SECTION; give the deliveries once")
    stated = _stated_type(data, path)

    coords = _numeric(data["node_coord"], source=path, what="NODE_COORD_SECTION")
    key = "demand" if "demand" in data else "linehaul"
    demand = _numeric(data[key], source=path, what=f"{key.upper()}_SECTION")
    depots = _numeric(data["depot"], source=path, what="DEPOT_SECTION").reshape(-1)
    capacity = _numeric(data["capacity"], source=path, what="CAPACITY").reshape(-1)
    if capacity.size != 1:
        raise ValueError(f"{path}: CAPACITY must be a single number, got {capacity.size} values")
    capacity = float(capacity[0])
    dim = data.get("dimension")

    if coords.ndim != 2 or coords.shape[1] != 2:
        raise ValueError(f"{path}: NODE_COORD_SECTION must have 2 coordinates per node (EUC_2D), got "
                         f"shape {coords.shape}")
    n_nodes = coords.shape[0]
    if dim is not None and int(dim) != n_nodes:
        raise ValueError(f"{path}: DIMENSION is {dim} but NODE_COORD_SECTION has {n_nodes} nodes")
    if demand.shape != (n_nodes,):
        raise ValueError(f"{path}: {key.upper()}_SECTION has {demand.size} entries for {n_nodes} nodes")
    if n_nodes < 2:
        raise ValueError(f"{path}: needs a depot and at least one customer, got {n_nodes} node(s)")
    # vrplib already turned the 1-based DEPOT_SECTION into 0-based indices and dropped the -1.
    if depots.size != 1:
        raise ValueError(f"{path}: DEPOT_SECTION lists {depots.size} depots "
                         f"({[int(d) + 1 for d in depots]}); exactly one (node 1) is supported")
    if int(depots[0]) != 0:
        raise ValueError(f"{path}: the depot is node {int(depots[0]) + 1}; only node 1 is supported")
    if not capacity > 0:
        raise ValueError(f"{path}: CAPACITY must be positive, got {capacity:g}")
    if demand[0] != 0:
        raise ValueError(f"{path}: the depot (node 1) has demand {demand[0]:g}; expected 0")
    if np.any(demand < 0):
        raise ValueError(f"{path}: negative demands at nodes {_nodes_1based(demand < 0)} (pickups go in "
                         "BACKHAUL_SECTION)")
    if np.any(demand > capacity):
        raise ValueError(f"{path}: demands exceed CAPACITY {capacity:g} at nodes "
                         f"{_nodes_1based(demand > capacity)}; no vehicle could serve them")

    pickup = _per_node(data, "backhaul", n_nodes, path, "BACKHAUL_SECTION")
    if pickup is not None:
        if pickup[0] != 0 or np.any(pickup < 0):
            raise ValueError(f"{path}: BACKHAUL_SECTION must hold non-negative pickups and 0 for the depot")
        if np.any((pickup > 0) & (demand > 0)):
            raise ValueError(f"{path}: nodes {_nodes_1based((pickup > 0) & (demand > 0))} both deliver and pick "
                             "up; in this environment a customer is either a linehaul or a backhaul")
        if np.any(pickup > capacity):
            raise ValueError(f"{path}: pickups exceed CAPACITY {capacity:g} at nodes "
                             f"{_nodes_1based(pickup > capacity)}; no vehicle could carry them")
    service = _per_node(data, "service_time", n_nodes, path, "SERVICE_TIME")
    windows = None
    if "time_window" in data:
        windows = _numeric(data["time_window"], source=path, what="TIME_WINDOW_SECTION")
        if windows.shape != (n_nodes, 2):
            raise ValueError(f"{path}: TIME_WINDOW_SECTION must give 'early late' for each of the {n_nodes} "
                             f"nodes, got shape {windows.shape}")
        if windows[0, 0] != 0:
            raise ValueError(f"{path}: the depot's time window opens at {windows[0, 0]:g}; it must open at 0 "
                             "(shift every time by that much)")
        if np.any(windows[:, 1] < windows[:, 0]) or np.any(windows < 0):
            bad = (windows[:, 1] < windows[:, 0]) | np.any(windows < 0, axis=1)
            raise ValueError(f"{path}: time windows closing before they open, or negative, at nodes "
                             f"{_nodes_1based(bad)}")
    if service is not None and np.any(service < 0):
        raise ValueError(f"{path}: negative service times at nodes {_nodes_1based(service < 0)}")
    if service is not None and windows is None and np.any(service[1:] != 0):
        raise ValueError(f"{path}: service times without TIME_WINDOW_SECTION; without time windows the "
                         "environment keeps no clock, so they could not be honoured")
    limit = _route_limit(data, path, has_time=windows is not None or (service is not None and np.any(service)))

    has_backhaul = pickup is not None and bool(np.any(pickup > 0))
    if stated is not None:
        missing = [what for need, have, what in (
            (stated.tw, windows is not None, "TIME_WINDOW_SECTION"),
            (stated.backhaul, pickup is not None, "BACKHAUL_SECTION"),
            (stated.limit, limit is not None, "a route limit (DISTANCE or VEHICLES_MAX_DISTANCE)"))
            if need and not have]
        if missing:
            raise ValueError(f"{path}: TYPE is {stated.name} but the file has no {' and no '.join(missing)}")
    var = problems.variant_from_flags(stated is not None and stated.open,
                                      has_backhaul or (stated is not None and stated.backhaul),
                                      limit is not None, windows is not None)

    offset, scale = unit_square_transform(coords, source=path, loc_scale=loc_scale,
                                          depot_close=None if windows is None else windows[0, 1],
                                          route_limit=limit)
    xy = to_unit_square(coords, offset, scale)
    signed = demand - (pickup if pickup is not None else 0.0)
    kwargs = {}
    if var.tw:
        svc = np.zeros(n_nodes) if service is None else service
        # Times share the coordinates' factor (no offset), so travel time = distance still holds.
        kwargs.update(service_time=svc[None, 1:] / scale, tw_start=windows[None, 1:, 0] / scale,
                      tw_end=windows[None, 1:, 1] / scale, depot_close=windows[0, 1] / scale)
    if var.limit:
        kwargs["route_limit"] = limit / scale
    rule = backhaul_rule if backhaul_rule is not None else ("classic" if var.backhaul else "paper")
    try:
        rule = problems.backhaul_rule_name(rule)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    inst = from_arrays(xy[None, :1], xy[None, 1:], signed[None, 1:], capacity, variant=var, backhaul_rule=rule,
                       **kwargs)
    reasons = checker.unservable_reasons(jax.tree.map(lambda x: x[0], inst), scale=scale,
                                         node_name=lambda i: f"node {i + 1}")
    if reasons:
        raise ValueError(f"{path}: {len(reasons)} customer(s) that no route can serve: " + "; ".join(reasons[:5]))
    vehicles = data.get("vehicles")
    meta = VrplibMeta(name=str(data.get("name", os.path.splitext(os.path.basename(path))[0])),
                      num_customers=n_nodes - 1, capacity=capacity, scale=scale,
                      offset=(float(offset[0]), float(offset[1])), variant=var.name, backhaul_rule=rule,
                      num_vehicles=int(vehicles) if isinstance(vehicles, (int, float)) else None, coords=coords,
                      cost_convention=vrplib_cost_convention(has_time_windows=windows is not None))
    return inst, meta


def vrplib_cost_convention(*, has_time_windows: bool) -> str:
    """How a VRPLIB file's best-known costs count an edge (``checker.COST_CONVENTIONS``): ``dimacs`` (truncated to
    one decimal) for a file with time windows, as CVRPLIB states its VRPTW sets (Solomon, Gehring-Homberger) and
    PyVRP's files of them; else ``nint`` (rounded to the nearest integer, CVRPLIB's EUC_2D)."""
    return "dimacs" if has_time_windows else "nint"


def _nodes_1based(mask: np.ndarray, limit: int = 10) -> str:
    """A short list of the (1-based, as in the file) node numbers where ``mask`` holds."""
    idx = (np.flatnonzero(mask) + 1).tolist()
    return str(idx[:limit])[:-1] + (", ...]" if len(idx) > limit else "]")


# ----------------------------------------------------------------------------------------------------
# Best-known solutions
# ----------------------------------------------------------------------------------------------------

def load_bks(path: str | os.PathLike, section: str | None = None) -> dict[str, float]:
    """Read a BKS table such as ``shared/data/mvmoe-paper/BKS.json`` -> {instance name: value}.

    The file is a JSON object whose object-valued entries are sections (``"Set-X"``, ``"Set-Solomon"``)
    mapping instance names to numbers; other entries (``"source"``) are ignored. With ``section`` only
    that section is returned; otherwise all sections are merged (a name in two sections is an error).
    """
    path = require_file(path)
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of sections, got {type(data).__name__}")
    sections = {k: v for k, v in data.items() if isinstance(v, dict)}
    if section is not None:
        if section not in sections:
            raise ValueError(f"{path}: no section {section!r}; sections: {sorted(sections)}")
        sections = {section: sections[section]}
    out: dict[str, float] = {}
    for sec, table in sections.items():
        for name, value in table.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{path}: {sec}/{name} is {value!r}, not a finite number")
            if name in out:
                raise ValueError(f"{path}: instance {name!r} appears in more than one section")
            out[name] = float(value)
    if not out:
        raise ValueError(f"{path}: no best-known values found")
    return out
