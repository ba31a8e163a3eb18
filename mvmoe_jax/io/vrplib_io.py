"""CVRPLIB (VRPLIB format) instances, e.g. Set X, and the paper's best-known-solution table.

``read_vrplib`` turns one ``.vrp`` file into a batch-of-one CVRP ``Instance`` in the unit square that the
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

import numpy as np

from mvmoe_jax.instances import Instance, from_arrays


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

def unit_square_transform(xy: np.ndarray, *, source: str,
                          loc_scale: float | None = None) -> tuple[np.ndarray, float]:
    """Offset and scale that map coordinates ``xy`` (N, 2) into [0, 1]^2 with distances scaled uniformly.

    Default (``loc_scale=None``): offset = the per-axis minimum over all nodes, scale = the largest
    extent over both axes, so the instance touches 0 and 1 along its longer axis. One factor for both
    axes keeps every distance proportional to the original one (``original = unit * scale``).

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
    return offset, scale


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
      scale:         multiply a unit-square cost by this to get the file's units.
      offset:        (x, y) subtracted from the raw coordinates before dividing by ``scale``.
      round_costs:   True: CVRPLIB's official objective (and so its BKS) rounds every edge length to
                     the nearest integer (the EUC_2D convention). Costs computed on our Instance are
                     UNROUNDED Euclidean lengths, and ``unit_cost * scale`` is the unrounded cost in file
                     units: up to half a unit per edge away from the rounded objective, so gaps to the BKS
                     computed from it are approximate. (The reference implementation's CVRPLIB
                     evaluation, with a fixed ``loc_scale`` of 1000, rounds every edge instead.)
    """

    name: str
    num_customers: int
    capacity: float
    scale: float
    offset: tuple[float, float]
    round_costs: bool = True

    def original_cost(self, unit_cost):
        """Unit-square cost(s) -> (unrounded) cost in the file's units."""
        return np.asarray(unit_cost, np.float64) * self.scale


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


def read_vrplib(path: str | os.PathLike, *, loc_scale: float | None = None) -> tuple[Instance, VrplibMeta]:
    """Read a CVRPLIB ``.vrp`` file (EUC_2D, one depot at node 1) as a batch-of-one CVRP Instance.

    Returns (Instance with locs (1, n+1, 2) in [0, 1]^2 and demand (1, n+1) = raw / capacity, meta).
    Coordinates are scaled as described in ``unit_square_transform`` (``loc_scale`` as there). Costs on
    the Instance are unrounded Euclidean lengths; ``meta.scale`` converts them to file units, still
    unrounded (CVRPLIB's own objective rounds each edge: see ``VrplibMeta.round_costs``).

    Raises ValueError (naming the file) for a missing file, an edge weight type other than EUC_2D, a
    missing CAPACITY / NODE_COORD / DEMAND / DEPOT section, a depot other than node 1 alone, a nonzero
    depot demand, negative demands or demands above capacity, and counts that disagree with DIMENSION.
    """
    path = require_file(path)
    data = _parse_vrplib(path)

    ewt = str(data.get("edge_weight_type", "")).upper()
    if ewt != "EUC_2D":
        found = f"is {ewt!r}" if ewt else "is missing"
        raise ValueError(f"{path}: EDGE_WEIGHT_TYPE {found}; only EUC_2D (Euclidean coordinates) is "
                         "supported")
    for key, label in (("capacity", "CAPACITY"), ("node_coord", "NODE_COORD_SECTION"),
                       ("demand", "DEMAND_SECTION"), ("depot", "DEPOT_SECTION")):
        if key not in data:
            raise ValueError(f"{path}: missing {label}")

    coords = _numeric(data["node_coord"], source=path, what="NODE_COORD_SECTION")
    demand = _numeric(data["demand"], source=path, what="DEMAND_SECTION")
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
        raise ValueError(f"{path}: DEMAND_SECTION has {demand.size} entries for {n_nodes} nodes")
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
        raise ValueError(f"{path}: negative demands at nodes {_nodes_1based(demand < 0)}")
    if np.any(demand > capacity):
        raise ValueError(f"{path}: demands exceed CAPACITY {capacity:g} at nodes "
                         f"{_nodes_1based(demand > capacity)}; no vehicle could serve them")

    offset, scale = unit_square_transform(coords, source=path, loc_scale=loc_scale)
    xy = to_unit_square(coords, offset, scale)
    inst = from_arrays(xy[None, :1], xy[None, 1:], demand[None, 1:], capacity, variant="CVRP")
    meta = VrplibMeta(name=str(data.get("name", os.path.splitext(os.path.basename(path))[0])),
                      num_customers=n_nodes - 1, capacity=capacity, scale=scale,
                      offset=(float(offset[0]), float(offset[1])))
    return inst, meta


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
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
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
