"""Batched Instances as ``.npz`` files: one array per Instance field plus a format version.

The format is plain numpy arrays (no pickled objects), so a file can be loaded with
``allow_pickle=False`` and is safe to read from untrusted sources. Round trips are exact: the arrays are
stored in the Instance's own dtypes (float32 / bool), including the +inf route limit of variants
without L.

Layout of a file holding B instances with n customers::

    __format_version__  int64 ()          FORMAT_VERSION
    locs                float32 (B, n+1, 2)
    demand, service_time, tw_start, tw_end   float32 (B, n+1)
    route_limit         float32 (B,)
    is_open, has_backhaul, has_limit, has_tw  bool (B,)
    backhaul_rule       int8 (B,)         index into problems.BACKHAUL_RULES (0 paper, 1 classic, 2 mixed)

Files of format version 1 (no ``backhaul_rule``) are read with the paper's rule, which was the only one then.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np

from mvmoe_jax import problems
from mvmoe_jax.instances import Instance
from mvmoe_jax.io.npz_sizes import read_arrays
from mvmoe_jax.io.vrplib_io import require_file

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)     # version 1: before backhaul rules (every instance under the paper's)
VERSION_KEY = "__format_version__"

# Per field: (dtype, trailing shape after the batch axis; "N" is the node count n+1).
_SPEC: dict[str, tuple[np.dtype, tuple]] = {
    "locs": (np.dtype(np.float32), ("N", 2)),
    "demand": (np.dtype(np.float32), ("N",)),
    "service_time": (np.dtype(np.float32), ("N",)),
    "tw_start": (np.dtype(np.float32), ("N",)),
    "tw_end": (np.dtype(np.float32), ("N",)),
    "route_limit": (np.dtype(np.float32), ()),
    "is_open": (np.dtype(bool), ()),
    "has_backhaul": (np.dtype(bool), ()),
    "has_limit": (np.dtype(bool), ()),
    "has_tw": (np.dtype(bool), ()),
    "backhaul_rule": (np.dtype(np.int8), ()),
}

FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Instance))
# The spec above must follow the dataclass: a new Instance field needs a new format version.
if set(FIELDS) != set(_SPEC):
    raise ImportError(f"mvmoe_jax.io.npz: format spec {sorted(_SPEC)} is out of date with the Instance "
                      f"fields {sorted(FIELDS)}")


def _check_arrays(arrays: dict[str, np.ndarray], source: str) -> None:
    """Every field present, with its dtype, shapes consistent with one batch size and node count, and
    finite float values (route_limit may be +inf, meaning no limit, where has_limit is false)."""
    missing = [f for f in FIELDS if f not in arrays]
    if missing:
        raise ValueError(f"{source}: missing Instance field(s) {missing}")
    locs = arrays["locs"]
    if locs.ndim != 3:
        raise ValueError(f"{source}: field 'locs' must have shape (batch, n+1, 2) (a batched Instance), "
                         f"got {locs.shape}")
    batch, nodes = locs.shape[:2]
    for name in FIELDS:
        dtype, trailing = _SPEC[name]
        arr = arrays[name]
        want = (batch,) + tuple(nodes if d == "N" else d for d in trailing)
        if arr.dtype != dtype:
            raise ValueError(f"{source}: field {name!r} has dtype {arr.dtype}, expected {dtype}")
        if arr.shape != want:
            raise ValueError(f"{source}: field {name!r} has shape {arr.shape}, expected {want} "
                             f"(batch {batch}, {nodes} nodes, from 'locs')")
    for name in FIELDS:
        arr = arrays[name]
        note = ""
        # +inf is how an instance without a route limit stores its route_limit; NaN and -inf are never valid.
        if name == "route_limit":
            bad = np.isnan(arr) | (arr == -np.inf) | (np.isinf(arr) & arrays["has_limit"])
            note = "; +inf stands for no route limit, only where has_limit is false"
        elif arr.dtype.kind == "f":
            bad = ~np.isfinite(arr)
        elif name == "backhaul_rule":
            bad = (arr < 0) | (arr >= len(problems.BACKHAUL_RULES))
            note = f"; a backhaul rule is an index 0..{len(problems.BACKHAUL_RULES) - 1} ({', '.join(problems.BACKHAUL_RULES)})"
        else:
            continue
        if bad.any():
            what = "invalid" if name == "backhaul_rule" else "non-finite"
            raise ValueError(f"{source}: field {name!r} holds {what} values (first at index "
                             f"{tuple(int(i) for i in np.argwhere(bad)[0])}){note}")


def save_npz(path: str | os.PathLike, instances: Instance, *, compressed: bool = False) -> None:
    """Write a batched Instance (every field with a leading batch axis) to ``path`` exactly as named
    (no ``.npz`` suffix is appended). ``compressed`` uses zip deflate (smaller, slower)."""
    path = os.fspath(path)
    arrays = {name: np.asarray(getattr(instances, name)) for name in FIELDS}
    _check_arrays(arrays, source="save_npz")
    arrays[VERSION_KEY] = np.asarray(FORMAT_VERSION, np.int64)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    # Writing through a file object stops numpy from appending ".npz" to the name.
    with open(path, "wb") as f:
        (np.savez_compressed if compressed else np.savez)(f, **arrays)


def load_npz(path: str | os.PathLike) -> Instance:
    """Read a file written by ``save_npz`` -> batched Instance (jax arrays).

    Raises ValueError naming the file and the problem: not an npz archive (truncated, empty, other bytes),
    pickled (object) arrays, an array or zip entry that claims more data than the file holds, a missing or
    unsupported format version, unknown keys, any missing field or field whose dtype or shape does not match
    the others, and NaN or infinite values (+inf only as the route limit of an instance without one).
    """
    path = require_file(path)
    arrays = read_arrays(path)
    if VERSION_KEY not in arrays:
        raise ValueError(f"{path}: no {VERSION_KEY!r} key; not written by save_npz")
    version = arrays.pop(VERSION_KEY)
    if version.shape != () or version.dtype.kind not in "iu" or int(version) not in READABLE_VERSIONS:
        raise ValueError(f"{path}: unsupported format version {version!r} (this reader knows "
                         f"{', '.join(map(str, READABLE_VERSIONS))})")
    if int(version) == 1 and "locs" in arrays and "backhaul_rule" not in arrays:
        arrays["backhaul_rule"] = np.zeros(arrays["locs"].shape[:1], np.int8)
    unknown = sorted(set(arrays) - set(FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; not an Instance file of format version "
                         f"{int(version)}")
    _check_arrays(arrays, source=path)
    return Instance(**{name: jnp.asarray(arrays[name]) for name in FIELDS})
