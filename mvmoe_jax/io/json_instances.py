"""A small JSON format for one's own instances.

A file holds one instance (a JSON object) or several (a list of objects)::

    {
      "name": "north-depot",                  optional; default: the file name (plus the index in a list)
      "capacity": 100,                        the vehicle capacity
      "depot": [0, 0],                        x, y
      "customers": [[3, 4], [6, 8], [9, 1]],  x, y of each customer; they are numbered 1..n in this order
      "demand": [10, -5, 7],                  one per customer; negative: a pickup (a backhaul customer)
      "backhauls": "classic",                 with pickups: how linehauls and backhauls share a route, "classic",
                                              "mixed" or "paper" (required with pickups; see below)
      "time_windows": [[0, 50], [10, 60], [0, 80]],   optional: [earliest, latest] start of service
      "service_times": 2,                     optional, with time windows: one number, or one per customer
      "depot_close": 100,                     with time windows: when the vehicles must be back at the depot
      "route_limit": 80,                      optional: the longest route (a distance)
      "open_routes": false,                   optional: routes end at their last customer
      "best_known": 25.2                      optional: a known cost, for the gap in summaries and plots
    }

Distances are Euclidean in the given coordinates, and time is measured in the same units (travel time =
distance). The variant is read off the data: B with negative demands, TW with time windows, L with a route
limit, O with open routes. With pickups the file must say which backhaul rule holds (docs/environment.md,
"Backhaul rules"), since the literature's problems differ and no choice is safe to assume:

- ``"classic"``: the VRP with backhauls of Toth and Vigo, VRPLIB and PyVRP: on a route every linehaul comes
  before any backhaul, a route starts with a linehaul, its deliveries and its pickups each fit the capacity;
- ``"mixed"``: linehauls and backhauls in any order; the vehicle leaves with the route's deliveries and the
  load on board never exceeds the capacity;
- ``"paper"``: the MVMoE paper's rule: the vehicle leaves full and a pickup frees room for later deliveries.

Each instance is scaled into the unit square like the VRPLIB files
(``vrplib_io.unit_square_transform``: times and the route limit by the same factor), and ``JsonMeta.scale``
maps costs back. The rules are the environment's (docs/environment.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import numpy as np

from mvmoe_jax import checker, problems
from mvmoe_jax.instances import Instance, from_arrays
from mvmoe_jax.io.vrplib_io import read_json, require_file, to_unit_square, unit_square_transform

REQUIRED = ("capacity", "depot", "customers", "demand")
OPTIONAL = ("name", "time_windows", "service_times", "depot_close", "route_limit", "open_routes", "best_known",
            "backhauls")


@dataclasses.dataclass(frozen=True)
class JsonMeta:
    """name; variant (read off the data); scale and offset: unit square -> the file's units (as
    ``VrplibMeta``); coords float64 (n+1, 2): the file's coordinates, depot first; best_known or None;
    backhaul_rule: the rule the instance is read under (``paper`` where it has no pickups and states none)."""

    name: str
    variant: str
    num_customers: int
    capacity: float
    scale: float
    offset: tuple[float, float]
    best_known: float | None = None
    coords: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    backhaul_rule: str = "paper"

    def original_cost(self, unit_cost):
        return np.asarray(unit_cost, np.float64) * self.scale


def _array(value, shape_desc: str, where: str, key: str, ndim: int) -> np.ndarray:
    """``value`` as float64 of ``ndim`` dimensions. Only JSON numbers count: numpy would read true as 1 and
    "3" as 3, so booleans, strings and nulls are refused by value."""
    try:
        cells = np.asarray(value, dtype=object)
    except ValueError:
        raise ValueError(f"{where}: '{key}' must be {shape_desc} of numbers") from None
    wrong = [v for v in cells.flat if type(v) not in (int, float)]
    if wrong and isinstance(wrong[0], list):
        raise ValueError(f"{where}: '{key}' must be {shape_desc} of numbers, with rows of one length")
    if wrong:
        raise ValueError(f"{where}: '{key}' must be {shape_desc} of numbers, found {json.dumps(wrong[0])[:40]}")
    arr = cells.astype(np.float64)
    if arr.ndim != ndim or not np.all(np.isfinite(arr)):
        raise ValueError(f"{where}: '{key}' must be {shape_desc} of finite numbers")
    return arr


def _number(obj: dict, key: str, where: str) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: '{key}' must be a finite number, got {value!r}")
    return float(value)


def _customers(indices: np.ndarray) -> str:
    idx = (np.flatnonzero(indices) + 1).tolist()
    return str(idx[:10])[:-1] + (", ...]" if len(idx) > 10 else "]")


def _backhaul_rule(obj: dict, where: str, has_pickups: bool, stated: str | None) -> str:
    """The rule named by ``stated`` (a caller's override), else by the 'backhauls' key; required with pickups."""
    if stated is not None:
        return problems.backhaul_rule_name(stated)
    if "backhauls" not in obj:
        if has_pickups:
            raise ValueError(f"{where}: the demands include pickups (negative values); say which backhaul rule holds "
                             f"with 'backhauls': {' or '.join(repr(r) for r in problems.BACKHAUL_RULES[::-1])} "
                             "(docs/environment.md)")
        return "paper"
    value = obj["backhauls"]
    if not isinstance(value, str) or value.strip().lower() not in problems.BACKHAUL_RULES:
        raise ValueError(f"{where}: 'backhauls' must be one of {', '.join(repr(r) for r in problems.BACKHAUL_RULES)}, "
                         f"got {json.dumps(value)[:40]}")
    return value.strip().lower()


def parse_instance(obj, where: str, default_name: str, backhaul_rule: str | None = None) -> tuple[Instance, JsonMeta]:
    """One JSON object -> (batch-of-one Instance, JsonMeta); ValueError prefixed with ``where``. ``backhaul_rule``
    overrides the file's 'backhauls'."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: an instance must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {', '.join(REQUIRED + OPTIONAL)}")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(repr(k) for k in missing)}")
    capacity = _number(obj, "capacity", where)
    if not capacity > 0:
        raise ValueError(f"{where}: 'capacity' must be positive, got {capacity:g}")
    depot = _array(obj["depot"], "[x, y]", where, "depot", 1)
    xy = _array(obj["customers"], "a list of [x, y]", where, "customers", 2)
    if depot.shape != (2,) or xy.shape[-1] != 2 or xy.shape[0] < 1:
        raise ValueError(f"{where}: 'depot' must be [x, y] and 'customers' a non-empty list of [x, y]")
    n = xy.shape[0]
    demand = _array(obj["demand"], "a list", where, "demand", 1)
    if demand.shape != (n,):
        raise ValueError(f"{where}: 'demand' has {demand.size} entries for {n} customers")
    if np.any(np.abs(demand) > capacity):
        raise ValueError(f"{where}: the demand of customer(s) {_customers(np.abs(demand) > capacity)} exceeds the "
                         f"capacity {capacity:g}; no vehicle could serve them")
    has_tw = "time_windows" in obj
    in_file_units = {}   # times and the route limit, divided by the scale once it is known
    if has_tw:
        tw = _array(obj["time_windows"], "a list of [earliest, latest]", where, "time_windows", 2)
        if tw.shape != (n, 2):
            raise ValueError(f"{where}: 'time_windows' must give [earliest, latest] for each of the {n} customers")
        if np.any(tw[:, 1] < tw[:, 0]) or np.any(tw < 0):
            bad = (tw[:, 1] < tw[:, 0]) | np.any(tw < 0, axis=1)
            raise ValueError(f"{where}: the time windows of customer(s) {_customers(bad)} close before they open "
                             "or are negative")
        if "depot_close" not in obj:
            raise ValueError(f"{where}: 'time_windows' need 'depot_close', the time by which vehicles must be back")
        close = _number(obj, "depot_close", where)
        service = np.zeros(n)
        if "service_times" in obj:
            raw = obj["service_times"]
            service = (np.full(n, _number(obj, "service_times", where)) if not isinstance(raw, list)
                       else _array(raw, "a number or a list", where, "service_times", 1))
            if service.shape != (n,) or np.any(service < 0):
                raise ValueError(f"{where}: 'service_times' must be one non-negative number or one per customer")
        in_file_units.update(service_time=service[None], tw_start=tw[None, :, 0], tw_end=tw[None, :, 1],
                             depot_close=close)
    elif "service_times" in obj or "depot_close" in obj:
        raise ValueError(f"{where}: 'service_times' and 'depot_close' need 'time_windows' (without them no clock "
                         "is kept)")
    if "route_limit" in obj:
        limit = _number(obj, "route_limit", where)
        if not limit > 0:
            raise ValueError(f"{where}: 'route_limit' must be positive, got {limit:g}")
        in_file_units["route_limit"] = limit
    is_open = obj.get("open_routes", False)
    if not isinstance(is_open, bool):
        raise ValueError(f"{where}: 'open_routes' must be true or false, got {is_open!r}")
    best = _number(obj, "best_known", where) if "best_known" in obj else None
    name = obj.get("name", default_name)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: 'name' must be a non-empty string")

    rule = _backhaul_rule(obj, where, bool(np.any(demand < 0)), backhaul_rule)
    var = problems.variant_from_flags(is_open, bool(np.any(demand < 0)), "route_limit" in obj, has_tw)
    coords = np.concatenate([depot[None], xy])
    offset, scale = unit_square_transform(coords, source=where, depot_close=in_file_units.get("depot_close"),
                                          route_limit=in_file_units.get("route_limit"))
    kwargs = {key: value / scale for key, value in in_file_units.items()}
    unit = to_unit_square(coords, offset, scale)
    inst = from_arrays(unit[None, :1], unit[None, 1:], demand[None], capacity, variant=var, backhaul_rule=rule,
                       **kwargs)
    reasons = checker.unservable_reasons(jax.tree.map(lambda x: x[0], inst), scale=scale)
    if reasons:
        raise ValueError(f"{where}: {len(reasons)} customer(s) that no route can serve: " + "; ".join(reasons[:5]))
    meta = JsonMeta(name=name.strip(), variant=var.name, num_customers=n, capacity=capacity, scale=scale,
                    offset=(float(offset[0]), float(offset[1])), best_known=best, coords=coords, backhaul_rule=rule)
    return inst, meta


def read_json_instances(path: str | os.PathLike, *, backhaul_rule: str | None = None
                        ) -> list[tuple[Instance, JsonMeta]]:
    """Read a JSON file of the format above: one (batch-of-one Instance, JsonMeta) per instance.
    ``backhaul_rule`` (a name of ``problems.BACKHAUL_RULES``) overrides every instance's 'backhauls'.

    Raises ValueError naming the file (and the instance, in a list) for text that is not JSON, unknown or
    missing keys, pickups without 'backhauls', values of the wrong kind or length, a demand above the capacity, windows that close
    before they open, and a customer no route can serve (a window closing before a vehicle can arrive, a
    route limit shorter than its round trip, ...)."""
    path = require_file(path)
    data = read_json(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    if isinstance(data, dict):
        return [parse_instance(data, path, stem, backhaul_rule)]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected an instance object or a non-empty list of them")
    width = len(str(len(data) - 1))
    return [parse_instance(obj, f"{path}, instance {i}", f"{stem}-{i:0{width}d}", backhaul_rule)
            for i, obj in enumerate(data)]
