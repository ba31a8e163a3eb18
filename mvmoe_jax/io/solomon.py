"""Solomon's VRPTW benchmark instances (the 56 ``C1/C2/R1/R2/RC1/RC2`` text files).

File layout (whitespace-separated, blank lines ignored, CRLF tolerated)::

    C101
    VEHICLE
    NUMBER     CAPACITY
      25         200
    CUSTOMER
    CUST NO.  XCOORD.   YCOORD.    DEMAND   READY TIME  DUE DATE   SERVICE   TIME
        0      40         50          0          0       1236          0        <- the depot
        1      45         68         10        912        967         90
        ...

``read_solomon`` returns a batch-of-one VRPTW ``Instance`` in the unit square by the rule every reader of the
package shares (``vrplib_io.unit_square_transform``), so the same data read from a Solomon file and from a
VRPLIB file gives the same Instance: the per-axis minimum coordinate is subtracted, and coordinates and every
time value (ready time, due date, service time, the depot's due date) are divided by one factor, ``max(largest
extent, depot due date / 3)``. The environment's "travel time = distance" therefore still holds and every
feasibility decision is the same as in the original units, while the depot's due date (its closing time
``tw_end[0]``) is at most 3, as in the generated training data. Type-2 instances, whose horizon is long, lie in
a corner of the square instead (RC2: coordinates within about [0, 0.32]); scaling them to the full square would
put their horizon far beyond anything the policy was trained on (docs/results.md, "Solomon scaling").
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from mvmoe_jax.checker import unreachable_customers
from mvmoe_jax.instances import Instance, from_arrays
from mvmoe_jax.io.vrplib_io import require_file, to_unit_square, unit_square_transform

# Columns of the CUSTOMER table, in file order.
COLUMNS = ("cust_no", "x", "y", "demand", "ready_time", "due_date", "service_time")


@dataclasses.dataclass(frozen=True)
class SolomonMeta:
    """What ``read_solomon`` knows beyond the normalised Instance.

      name:          the instance's name (first line, e.g. ``C101``).
      num_customers: n (customers 1..n; the depot is customer 0).
      num_vehicles:  the file's VEHICLE NUMBER (not enforced by the environment, which has no fleet
                     limit).
      capacity:      the raw vehicle capacity (demands in the Instance are divided by it).
      scale:         multiply a unit-square cost (or time) by this to get the file's units. Costs are
                     unrounded Euclidean lengths.
      offset:        (x, y) subtracted from the raw coordinates before dividing by ``scale``.
      coords:        float64 (n+1, 2): the file's coordinates, depot first (for costs in its units).
      cost_convention: how the instance's best-known costs count an edge (``checker.COST_CONVENTIONS``):
                     ``dimacs``, every edge truncated to one decimal, as CVRPLIB and the literature state
                     Solomon's best-known values.
    """

    name: str
    num_customers: int
    num_vehicles: int
    capacity: float
    scale: float
    offset: tuple[float, float]
    cost_convention: str = "dimacs"
    coords: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def original_cost(self, unit_cost):
        """Unit-square cost(s) -> cost in the file's units."""
        return np.asarray(unit_cost, np.float64) * self.scale


@dataclasses.dataclass(frozen=True)
class _RawSolomon:
    """The file's numbers, unscaled. ``table`` is float64 (n+1, 7) in ``COLUMNS`` order, depot first."""

    name: str
    num_vehicles: int
    capacity: float
    table: np.ndarray


# ----------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------

def _content_lines(text: str) -> list[tuple[int, list[str]]]:
    """(1-based line number, tokens) for every non-blank line."""
    return [(no, line.split()) for no, line in enumerate(text.splitlines(), 1) if line.strip()]


def _find_keyword(lines, keyword: str, source: str) -> int:
    """Index into ``lines`` of the line consisting of ``keyword`` alone (case-insensitive)."""
    for k, (_, toks) in enumerate(lines):
        if len(toks) == 1 and toks[0].upper() == keyword:
            return k
    raise ValueError(f"{source}: missing {keyword} section")


def _number(tok: str, *, source: str, line: int, what: str) -> float:
    try:
        value = float(tok)
    except ValueError:
        raise ValueError(f"{source}, line {line}: {what} is {tok!r}, not a number") from None
    if not np.isfinite(value):
        raise ValueError(f"{source}, line {line}: {what} is {tok!r}, not a finite number")
    return value


def _parse_vehicle(lines, k: int, source: str) -> tuple[int, float]:
    """The VEHICLE section starting at ``lines[k]``: a 'NUMBER CAPACITY' header then two numbers."""
    body = lines[k + 1:k + 3]
    if len(body) < 2 or body[0][1][0].upper() != "NUMBER":
        raise ValueError(f"{source}: the VEHICLE section must be followed by a 'NUMBER CAPACITY' header "
                         "and a line with the two values")
    line, toks = body[1]
    if len(toks) != 2:
        raise ValueError(f"{source}, line {line}: expected 2 values (vehicle number, capacity), got "
                         f"{len(toks)}")
    number = _number(toks[0], source=source, line=line, what="the vehicle number")
    capacity = _number(toks[1], source=source, line=line, what="the capacity")
    if number < 1 or number != int(number):
        raise ValueError(f"{source}, line {line}: the vehicle number must be a positive integer, got "
                         f"{toks[0]}")
    if capacity <= 0:
        raise ValueError(f"{source}, line {line}: the capacity must be positive, got {toks[1]}")
    return int(number), capacity


def _parse_customers(lines, k: int, source: str) -> np.ndarray:
    """The CUSTOMER section starting at ``lines[k]``: a column header, then rows of 7 numbers to EOF."""
    if k + 1 >= len(lines) or not lines[k + 1][1][0].upper().startswith("CUST"):
        raise ValueError(f"{source}: the CUSTOMER section must start with a column header "
                         "('CUST NO. XCOORD. YCOORD. DEMAND READY TIME DUE DATE SERVICE TIME')")
    rows = []
    for line, toks in lines[k + 2:]:
        if len(toks) != len(COLUMNS):
            raise ValueError(f"{source}, line {line}: expected {len(COLUMNS)} columns "
                             f"({', '.join(COLUMNS)}), got {len(toks)}")
        rows.append([_number(t, source=source, line=line, what=c) for t, c in zip(toks, COLUMNS)])
        if rows[-1][0] != len(rows) - 1:
            raise ValueError(f"{source}, line {line}: customer number {toks[0]} out of sequence "
                             f"(expected {len(rows) - 1}; the depot is customer 0)")
    if len(rows) < 2:
        raise ValueError(f"{source}: the CUSTOMER table needs the depot and at least one customer, got "
                         f"{len(rows)} row(s)")
    return np.asarray(rows, np.float64)


def parse_solomon_text(text: str, source: str = "<text>") -> _RawSolomon:
    """Parse the text of a Solomon file into its raw numbers (no scaling, no feasibility check)."""
    lines = _content_lines(text)
    if not lines:
        raise ValueError(f"{source}: empty file")
    name = lines[0][1][0]
    num_vehicles, capacity = _parse_vehicle(lines, _find_keyword(lines, "VEHICLE", source), source)
    table = _parse_customers(lines, _find_keyword(lines, "CUSTOMER", source), source)
    return _RawSolomon(name=name, num_vehicles=num_vehicles, capacity=capacity, table=table)


def _validate(raw: _RawSolomon, source: str) -> None:
    """Checks on the raw numbers that the environment cannot represent or that no route can meet."""
    t = raw.table
    demand, ready, due, service = t[:, 3], t[:, 4], t[:, 5], t[:, 6]
    if np.any(due < ready):
        bad = np.flatnonzero(due < ready)
        raise ValueError(f"{source}: due date before ready time for customer(s) {bad[:10].tolist()}")
    if np.any(t[:, 3:] < 0):
        bad = np.flatnonzero(np.any(t[:, 3:] < 0, axis=1))
        raise ValueError(f"{source}: negative demand or time values for customer(s) {bad[:10].tolist()}")
    # The environment's depot has demand 0, opens at time 0 and takes no service time.
    if demand[0] != 0 or ready[0] != 0 or service[0] != 0:
        raise ValueError(f"{source}: the depot (customer 0) must have demand 0, ready time 0 and service "
                         f"time 0, got {demand[0]:g}, {ready[0]:g}, {service[0]:g}")
    if np.any(demand > raw.capacity):
        bad = np.flatnonzero(demand > raw.capacity)
        raise ValueError(f"{source}: demand above the capacity {raw.capacity:g} for customer(s) "
                         f"{bad[:10].tolist()}")


# ----------------------------------------------------------------------------------------------------
# Feasibility under the environment
# ----------------------------------------------------------------------------------------------------

def _check_round_trips(inst: Instance, source: str) -> None:
    ok = ~np.asarray(unreachable_customers(inst))[0]
    if not ok.all():
        bad = (np.flatnonzero(~ok) + 1).tolist()
        raise ValueError(f"{source}: customer(s) {bad[:10]} cannot be served even by a dedicated route "
                         "depot -> customer -> depot within the time windows (after scaling); the "
                         "instance has no feasible solution under the environment")


# ----------------------------------------------------------------------------------------------------
# Public reader
# ----------------------------------------------------------------------------------------------------

def read_solomon(path: str | os.PathLike, *, loc_scale: float | None = None) -> tuple[Instance, SolomonMeta]:
    """Read a Solomon ``.txt`` file as a batch-of-one VRPTW Instance.

    Returns (Instance: locs (1, n+1, 2) in [0, 1]^2, demand (1, n+1) = raw / capacity, service_time /
    tw_start / tw_end (1, n+1) = raw times / scale with tw_end[:, 0] the depot's scaled due date, meta).
    ``loc_scale`` fixes the factor instead (as in ``vrplib_io.unit_square_transform``).

    Raises ValueError (naming the file) for a missing file, missing VEHICLE / CUSTOMER sections, rows
    with a wrong column count or non-numeric fields, customer numbers out of sequence, a due date before
    a ready time, negative values, a depot with demand / ready time / service time other than 0, demand
    above capacity, and a customer that no single route depot -> customer -> depot can serve.
    """
    path = require_file(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        raw = parse_solomon_text(f.read(), source=path)
    _validate(raw, path)

    t = raw.table
    offset, scale = unit_square_transform(t[:, 1:3], source=path, loc_scale=loc_scale, depot_close=t[0, 5])
    xy = to_unit_square(t[:, 1:3], offset, scale)
    # Times share the coordinates' factor (no offset: time 0 stays the start), so time = distance holds.
    ready, due, service = t[:, 4] / scale, t[:, 5] / scale, t[:, 6] / scale
    inst = from_arrays(xy[None, :1], xy[None, 1:], t[None, 1:, 3], raw.capacity, variant="VRPTW",
                       service_time=service[None, 1:], tw_start=ready[None, 1:], tw_end=due[None, 1:],
                       depot_close=due[0])
    _check_round_trips(inst, path)
    meta = SolomonMeta(name=raw.name, num_customers=t.shape[0] - 1, num_vehicles=raw.num_vehicles,
                       capacity=raw.capacity, scale=scale, offset=(float(offset[0]), float(offset[1])),
                       coords=t[:, 1:3].copy())
    return inst, meta
