"""Any input -> the problems to solve: files or folders of VRPLIB ``.vrp``, Solomon ``.txt``, the paper's
``.pkl``, ``.npz`` batches and JSON (``mvmoe_jax.io.json_instances``). VRPLIB and Solomon files are told apart by
their content, whatever their extension (``io.formats.text_format``).

Each instance becomes a ``Problem``: the unit-square Instance the model solves, and what maps its solution
back to the file (names, the factor to the file's units, the file's coordinates). The variant is read off
the data; a stated one (``problem``) must agree with it on backhauls, route limits and time windows and
decides open routes. A file that cannot be used is refused with a one-line reason naming it; the others are
still read.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from mvmoe_jax import checker, env, problems
from mvmoe_jax.instances import Instance, stack, with_backhaul_rule
from mvmoe_jax.io import (load_bks, load_npz, load_paper_instances, read_json_instances, read_solomon, read_vrplib,
                          safe_pickle, variant_from_filename)
from mvmoe_jax.io.formats import SOLOMON, VRPLIB, text_format
from mvmoe_jax.io.paper import expected_fields

FORMATS = {".vrp": "VRPLIB", ".txt": "Solomon", ".pkl": "the paper's pickle", ".npz": "npz batch", ".json": "JSON"}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One instance to solve.

      name:        unique among a run's problems; the stem of its output files.
      source:      the file it came from (with ``#i`` for the i-th instance of a file of several).
      instance:    the unbatched Instance (n customers, unit square) the model solves.
      scale:       unit-square lengths and times x scale = the file's units.
      coords:      float64 (n+1, 2), the file's coordinates, depot first.
      cost_convention: how the file's best-known costs count an edge (``checker.COST_CONVENTIONS``: ``exact``,
                   ``nint`` for CVRPLIB's EUC_2D files, ``dimacs`` for VRPLIB files with time windows and
                   Solomon files); the cost under it is reported beside the exact one and compared with a
                   best-known value.
      best_known:  a best-known cost in the file's units, or None.
      notes:       what the reading found worth a warning (one line each, without the name), e.g. a best-known
                   value left out because the instance is not the size its name stands for.
    """

    name: str
    source: str
    instance: Instance
    scale: float = 1.0
    coords: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    cost_convention: str = "exact"
    best_known: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def num_customers(self) -> int:
        return int(self.instance.locs.shape[-2]) - 1

    @property
    def variant(self) -> str:
        return problems.variant_from_flags(*np.asarray(self.instance.flags)).name

    @property
    def backhaul_rule(self) -> str:
        """The backhaul rule the instance is solved under (``problems.BACKHAUL_RULES``)."""
        return problems.backhaul_rule_name(int(np.asarray(self.instance.backhaul_rule)))


@dataclasses.dataclass(frozen=True)
class Refused:
    """An input that could not be used, and why (one line, naming the file)."""

    source: str
    error: str


def _single(batch: Instance, i: int = 0) -> Instance:
    return jax.tree.map(lambda x: x[i], batch)


def state_variant(inst: Instance, stated: problems.Variant, source: str) -> Instance:
    """``inst`` (unbatched) as the ``stated`` variant: its data must agree on route limits and time windows
    and have no backhauls unless B is stated; open routes are the statement's."""
    has_tw, has_limit = bool(inst.has_tw), bool(inst.has_limit)
    has_back = bool(np.any(np.asarray(inst.demand) < 0))
    for want, have, what in ((stated.tw, has_tw, "time windows"), (stated.limit, has_limit, "a route limit")):
        if want != have:
            raise ValueError(f"{source}: --problem={stated.name} but the data {'has no' if want else 'has'} {what}")
    if has_back and not stated.backhaul:
        raise ValueError(f"{source}: --problem={stated.name} but the data has backhaul customers (negative demands)")
    return inst.replace(is_open=jnp.asarray(stated.open), has_backhaul=jnp.asarray(stated.backhaul))


def _pickle_variant(path: str) -> problems.Variant:
    """The variant of a paper pickle whose name does not say it: L and TW from the number of fields, B from
    negative demands; open routes cannot be seen in the data (state them with ``problem``)."""
    data = safe_pickle.load(path)
    if not isinstance(data, (list, tuple)) or not data or not isinstance(data[0], (list, tuple)):
        raise ValueError(f"{path}: expected a non-empty list of instances")
    row = data[0]
    if len(row) == 2 and isinstance(row[1], (list, tuple)) and all(
            isinstance(v, (int, np.integer)) for v in row[1][:5]):
        raise ValueError(f"{path}: a solution file (cost, route pairs), not instances")
    by_fields = {expected_fields(v): v for v in problems.VARIANTS if not v.open and not v.backhaul}
    if len(row) not in by_fields:
        raise ValueError(f"{path}: instances of {len(row)} fields; the paper's have 4, 5, 7 or 8")
    var = by_fields[len(row)]
    try:
        back = any(np.any(np.asarray(r[2], np.float64) < 0) for r in data[:100])
    except (TypeError, ValueError, IndexError):     # malformed demands: load_paper_instances names the problem
        back = False
    return problems.variant_from_flags(False, back, var.limit, var.tw)


def _batch_problems(batch: Instance, path: str, num_instances: int | None) -> list[Problem]:
    stem = os.path.splitext(os.path.basename(path))[0]
    batch = jax.device_get(batch)          # split on the host: thousands of small device slices are slow
    k = int(batch.locs.shape[0]) if num_instances is None else min(num_instances, int(batch.locs.shape[0]))
    width = len(str(max(k - 1, 0)))
    out = []
    for i in range(k):
        inst = _single(batch, i)
        out.append(Problem(name=f"{stem}-{i:0{width}d}", source=f"{path}#{i}", instance=inst,
                           coords=np.asarray(inst.locs, np.float64)))
    return out


def read_file(path: str, *, num_instances: int | None = None, backhaul_rule: str | None = None) -> list[Problem]:
    """The problems in one file, with the variant the data shows, under the backhaul rule the file states or
    implies (VRPLIB: classic; the paper's data and npz: as stored; JSON: its 'backhauls'), or ``backhaul_rule``
    where given. Raises ValueError naming the file."""
    read = _read_file(path, num_instances, backhaul_rule)
    if backhaul_rule is not None:
        read = [dataclasses.replace(p, instance=with_backhaul_rule(p.instance, backhaul_rule)) for p in read]
    return read


BINARY_OR_JSON = (".json", ".npz", ".pkl")      # formats known by their extension alone


def file_format(path: str) -> str:
    """The format of the file at ``path``: for a text instance file ``VRPLIB`` or ``Solomon`` by its content,
    else by its extension (``.vrp`` VRPLIB, ``.txt`` Solomon, where the content is too damaged to tell); a name of
    ``FORMATS`` for the others. ValueError naming the file for an unknown one."""
    ext = os.path.splitext(path)[1].lower()
    found = None if ext in BINARY_OR_JSON else text_format(path)
    found = found or FORMATS.get(ext)
    if found is None:
        raise ValueError(f"{path}: unknown format {ext or '(no suffix)'}; expected one of {', '.join(FORMATS)} "
                         "(VRPLIB and Solomon files are recognised by their content under any name)")
    return found


def _read_file(path: str, num_instances: int | None, backhaul_rule: str | None) -> list[Problem]:
    fmt = file_format(path)
    if fmt == VRPLIB:
        inst, meta = read_vrplib(path, backhaul_rule=backhaul_rule)
        return [Problem(meta.name, path, _single(inst), meta.scale, meta.coords,
                        cost_convention=meta.cost_convention)]
    if fmt == SOLOMON:
        inst, meta = read_solomon(path)
        return [Problem(meta.name, path, _single(inst), meta.scale, meta.coords, cost_convention=meta.cost_convention)]
    if fmt == FORMATS[".json"]:
        read = read_json_instances(path, backhaul_rule=backhaul_rule)
        many = len(read) > 1
        return [Problem(meta.name, f"{path}#{i}" if many else path, _single(inst), meta.scale, meta.coords,
                        best_known=meta.best_known)
                for i, (inst, meta) in enumerate(read[:num_instances])]
    if fmt == FORMATS[".npz"]:
        return _batch_problems(load_npz(path), path, num_instances)
    try:                                            # the paper's pickle
        var = variant_from_filename(path)
    except ValueError:
        var = _pickle_variant(path)
    return _batch_problems(load_paper_instances(path, var, num_instances=num_instances), path, None)


def check_servable(read: list[Problem], path: str) -> list[Problem]:
    """``read`` unchanged when every customer of every problem can be served; otherwise a ValueError naming
    the file, the instance and why (``checker.unservable_reasons``)."""
    if not read:
        return read
    bad = np.array([np.any(np.abs(np.asarray(p.instance.demand, np.float64)) > 1 + env.EPS) for p in read])
    timed = np.array([bool(p.instance.has_tw) or bool(p.instance.has_limit) or checker.needs_classic_check(p.instance)
                      for p in read])
    if timed.any():      # only time windows, route limits and the classic rule's order need the environment's replay
        replay = checker.unreachable_customers(stack([p.instance for p, t in zip(read, timed) if t]))
        bad[timed] |= np.asarray(replay).any(axis=1)
    for i in np.flatnonzero(bad)[:1]:
        p = read[i]
        node = (lambda k: f"node {k + 1}") if file_format(path) == VRPLIB else (lambda k: f"customer {k}")
        reasons = checker.unservable_reasons(p.instance, scale=p.scale, node_name=node)
        where = p.source if len(read) > 1 else path
        raise ValueError(f"{where}: {len(reasons)} customer(s) that no route can serve: " + "; ".join(reasons[:5])
                         + (f" ({int(bad.sum())} instances of the file have such customers)" if bad.sum() > 1 else ""))
    return read


def _read_stated(path: str, stated: problems.Variant, num_instances: int | None,
                 backhaul_rule: str | None = None) -> list[Problem]:
    """``read_file`` for a stated variant: a paper pickle is read as that variant (its name may say another)."""
    if path.lower().endswith(".pkl"):
        batch = load_paper_instances(path, stated, num_instances=num_instances)
        if backhaul_rule is not None:
            batch = with_backhaul_rule(batch, backhaul_rule)
        read = _batch_problems(batch, path, None)
    else:
        read = read_file(path, num_instances=num_instances, backhaul_rule=backhaul_rule)
    return [dataclasses.replace(p, instance=state_variant(p.instance, stated, p.source)) for p in read]


def collect_files(paths) -> tuple[list[str], list[Refused]]:
    """Files named, and the files of known formats in folders named (sorted, not recursive); a path that does
    not exist is refused."""
    files, refused = [], []
    for p in [os.fspath(p) for p in paths]:
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p)
                           if os.path.splitext(f)[1].lower() in FORMATS and os.path.isfile(os.path.join(p, f)))
            if not found:
                refused.append(Refused(p, f"{p}: no files of a known format ({', '.join(FORMATS)}) in this folder"))
            files.extend(found)
        elif os.path.isfile(p):
            files.append(p)
        else:
            refused.append(Refused(p, f"{p}: no such file or folder"))
    return files, refused


# Benchmark names that fix the number of customers: (pattern, customers from the match, what the name stands for).
STANDARD_SIZES = (
    (re.compile(r"(C|R|RC)[12]\d\d", re.IGNORECASE), lambda m: 100, "Solomon instances have 100 customers"),
    (re.compile(r"(C|R|RC)[12]_(\d+)_\d+", re.IGNORECASE), lambda m: 100 * int(m.group(2)),
     "Gehring-Homberger names give the customers in hundreds"),
    (re.compile(r"[A-Z]+-n(\d+)-k\d+", re.IGNORECASE), lambda m: int(m.group(1)) - 1,
     "CVRPLIB names give the nodes, depot included"),
)


def standard_size(name: str) -> tuple[int, str] | None:
    """(customers, why) when ``name`` is a benchmark name that fixes them (``STANDARD_SIZES``), else None."""
    for pattern, customers, why in STANDARD_SIZES:
        m = pattern.fullmatch(name)
        if m:
            return customers(m), why
    return None


def _table_best_known(p: Problem, table: dict[str, float]) -> tuple[float | None, tuple[str, ...]]:
    """The best-known value of ``p`` from a table looked up by its name, and notes: none is taken when the name
    stands for another number of customers (a file cut short, or a smaller version of the instance)."""
    best = table.get(p.name)
    standard = standard_size(p.name)
    if best is None or standard is None or standard[0] == p.num_customers:
        return best, ()
    return None, (f"the best-known value {best:g} of {p.name} is not used: the file has {p.num_customers} customers "
                  f"but {standard[1]} ({standard[0]} here); is the file cut short?",)


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "instance"


def read_inputs(paths, *, problem: str | None = None, num_instances: int | None = None,
                bks: str | None = None, backhauls: str | None = None) -> tuple[list[Problem], list[Refused]]:
    """Every problem in ``paths`` (files or folders) and the inputs refused. ``problem``: the stated variant;
    ``num_instances``: at most this many from each file of several; ``bks``: a best-known-value table
    (``io.load_bks``: BKS.json style), looked up by instance name (a JSON file's own best_known wins);
    ``backhauls``: the backhaul rule for every instance (``problems.BACKHAUL_RULES``), overriding the files'."""
    stated = None if problem is None else problems.get_variant(problem)
    if backhauls is not None:
        backhauls = problems.backhaul_rule_name(backhauls)
    table = load_bks(bks) if bks else {}
    files, refused = collect_files(paths)
    out, used = [], set()
    for path in files:
        try:
            read = check_servable(read_file(path, num_instances=num_instances, backhaul_rule=backhauls)
                                  if stated is None else _read_stated(path, stated, num_instances, backhauls), path)
        except (ValueError, OSError) as e:
            message = " ".join(str(e).split())
            refused.append(Refused(path, message if path in message else f"{path}: {message}"))
            continue
        for p in read:
            name, k = _safe_name(p.name), 1
            while name in used:
                k += 1
                name = f"{_safe_name(p.name)}-{k}"
            used.add(name)
            best, notes = (p.best_known, ()) if p.best_known is not None else _table_best_known(p, table)
            out.append(dataclasses.replace(p, name=name, best_known=best, notes=p.notes + notes))
    return out, refused
