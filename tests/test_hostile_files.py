"""Hostile files: every format the project reads, damaged every way this matrix knows, is refused with an error
that names the file and the problem, and nothing in the file runs.

Formats, and the entry point each case goes through (what a user runs):
  .vrp (VRPLIB), .txt (Solomon), .json, .npz batch, .pkl (the paper's)   solve.inputs.read_inputs
  a torch .pt checkpoint                                                  checkpoints.load_policy(path)
  a shipped model's params.npz                                            checkpoints.load_policy(name)
  an exported training state (meta.json, state_00.npz)                    python -m mvmoe_jax.portable_state import

Damage kinds (``DAMAGE_KINDS``): truncated at three cut points, empty, random bytes, a wrong shape, a wrong
dtype, NaN / +inf / -inf in every numeric field the format has, and the format's own attacks: pickles whose
reduce would run a shell command or that name a callable outside the allow-list, headers claiming huge sizes,
JSON nested too deeply, a file name leading out of its folder. Each damage is applied to a small valid file
written here (no ../shared data), and the intact file is checked to be accepted, so each refusal is the
damage's. Every code-running payload would create the file ``MARKER``; no case may leave it behind.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re
import shlex
import shutil
import struct
import zipfile
from typing import Callable

import numpy as np
import pytest
from flax import traverse_util

from configs.common import model_config
from mvmoe_jax import checkpoints, portable_state, shipped, training_loop
from mvmoe_jax.instances import from_arrays
from mvmoe_jax.io import npz as npz_io
from mvmoe_jax.io import save_npz
from mvmoe_jax.nn.policy import PolicyConfig
from mvmoe_jax.solve import inputs
from test_io import SOLOMON_HEADER, _claims_huge_shape, _Hostile, write_solomon
from test_solve import OK_DEMAND, SQUARE, vrp_text
from test_torch_checkpoint import Call, Global, Storage, dumps, tensor, write_checkpoint
from test_training import tiny_config

MARKER = "code-ran"
DAMAGE_KINDS = ("truncated", "empty", "random bytes", "shape", "dtype", "non-finite", "attack")
CUTS = (0.25, 0.5, 0.75)           # where files are truncated, as fractions of their size
NON_FINITE = {"nan": float("nan"), "plus-inf": float("inf"), "minus-inf": float("-inf")}


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile file: its format, the kind of damage, a writer (folder -> the path handed to the entry
    point) and the regular expressions its error must all match (the problem in words)."""

    fmt: str
    damage: str
    name: str
    write: Callable
    expect: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.fmt}-{self.name}"


def params(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.id) for c in cases]


# ----------------------------------------------------------------------------------------------------
# Damage for any format, and payloads that would run code
# ----------------------------------------------------------------------------------------------------

def damaged(write_valid: Callable, change: Callable[[bytes], bytes], member: str | None = None) -> Callable:
    """A writer: the valid file (or the file ``member`` of the valid folder), then ``change`` applied to its
    bytes."""
    def write(folder):
        path = write_valid(folder)
        target = path / member if member else path
        target.write_bytes(change(target.read_bytes()))
        return path
    return write


def cut(fraction: float, text: bool) -> Callable[[bytes], bytes]:
    """Keep ``fraction`` of the bytes. A text file ends just after the next space, mid-row: a row missing its
    last fields is damage a reader can see, whereas a cut at a line break is not, in formats that state no
    counts (a Solomon file of fewer customers is a valid file)."""
    def change(data: bytes) -> bytes:
        at = int(len(data) * fraction)
        return data[:data.index(b" ", at) + 1] if text else data[:at]
    return change


def random_bytes(_: bytes) -> bytes:
    return np.random.default_rng(0).bytes(512)


def byte_damages(fmt: str, write_valid: Callable, *, text: bool, truncated: str, empty: str, random: str,
                 member: str | None = None, prefix: str = "") -> list[Case]:
    """Truncated at each of ``CUTS``, emptied, and replaced by random bytes, each with the phrase its error
    must contain."""
    cases = [Case(fmt, "truncated", f"{prefix}truncated-at-{int(f * 100)}%",
                  damaged(write_valid, cut(f, text), member), (truncated,)) for f in CUTS]
    return cases + [
        Case(fmt, "empty", f"{prefix}empty", damaged(write_valid, lambda _: b"", member), (empty,)),
        Case(fmt, "random bytes", f"{prefix}random-bytes", damaged(write_valid, random_bytes, member), (random,))]


def replaced(text: str, old: str, new: str) -> str:
    """``text`` with its one ``old`` replaced: the damage lands exactly where it is meant to."""
    assert text.count(old) == 1, (old, text)
    return text.replace(old, new)


def text_file(path, text: str):
    path.write_text(text)
    return path


def bytes_file(path, data: bytes):
    path.write_bytes(data)
    return path


def touch_marker(folder) -> str:
    """The shell command the code-running payloads carry: it creates ``folder / MARKER``."""
    return f"touch {shlex.quote(str(folder / MARKER))}"


def eval_marker(folder) -> str:
    """The Python expression the eval payloads carry: it creates ``folder / MARKER``."""
    return f"open({str(folder / MARKER)!r}, 'w').close()"


def object_array_running_code(folder) -> np.ndarray:
    """An object array whose pickle would run ``touch_marker`` when loaded."""
    return np.array([_Hostile(touch_marker(folder))], dtype=object)


def forge_entry_size(path, member: str, claimed: int) -> None:
    """Rewrite the uncompressed size that ``member``'s zip entry states, in its local header and in the
    central directory, as a forger would; the data stays as it is."""
    data = bytearray(path.read_bytes())
    for signature, size_at, name_length_at, name_at in ((b"PK\x03\x04", 22, 26, 30), (b"PK\x01\x02", 24, 28, 46)):
        start = data.find(signature)
        while start >= 0:
            length = struct.unpack_from("<H", data, start + name_length_at)[0]
            if data[start + name_at:start + name_at + length] == member.encode():
                struct.pack_into("<I", data, start + size_at, claimed)
            start = data.find(signature, start + 4)
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as archive:
        assert archive.getinfo(member).file_size == claimed       # the forgery took


def npz_forged(path, member: str, shape: tuple):
    """An .npz whose one member's .npy header states ``shape`` of float32 but holds 16 bytes, and whose zip
    entry is forged to state as many bytes as the header asks for, so that the two agree."""
    header = np.lib.format.header_data_from_array_1_0(np.zeros(0, np.float32)) | {"shape": shape}
    with zipfile.ZipFile(path, "w") as archive, archive.open(f"{member}.npy", "w") as out:
        np.lib.format.write_array_header_1_0(out, header)
        out.write(np.zeros(4, np.float32).tobytes())
    with zipfile.ZipFile(path) as archive:
        header_bytes = archive.getinfo(f"{member}.npy").file_size - 16
    forge_entry_size(path, f"{member}.npy", header_bytes + int(np.prod(shape)) * 4)
    return path


def test_the_code_running_payloads_are_live(tmp_path):
    """Control: under a plain unpickler the payloads of this matrix do run, so their refusal is what stops them."""
    for payload in (pickle.dumps(_Hostile(touch_marker(tmp_path))),
                    dumps(Call(Global("builtins", "eval"), eval_marker(tmp_path)))):
        pickle.loads(payload)
        assert (tmp_path / MARKER).exists()
        (tmp_path / MARKER).unlink()


# ----------------------------------------------------------------------------------------------------
# The valid instance, in every instance format
# ----------------------------------------------------------------------------------------------------

# A depot and 3 customers, with time windows (depot first: [0, its closing time]), service times and a route
# limit, so that every numeric field a format can hold is present; in file units (x 100 the unit square).
VALID = dict(coords=SQUARE.tolist(), demand=list(OK_DEMAND), capacity=30.0, limit=100.0,
             windows=[[0, 100], [0, 50], [0, 60], [0, 80]], service=[0, 1, 1, 1])


def spec(**changes) -> dict:
    return {**copy.deepcopy(VALID), **changes}


def with_value(field: str, value) -> dict:
    """The valid instance with one entry of ``field`` (customer 2's, for a field per node) set to ``value``."""
    s = spec()
    if field == "coords":
        s["coords"][2][0] = value
    elif field == "windows":
        s["windows"][2][1] = value
    elif field in ("demand", "service"):
        s[field][2] = value
    else:
        s[field] = value
    return s


def short(field: str) -> dict:
    """The valid instance with ``field`` one node short."""
    return spec(**{field: VALID[field][:-1]})


def three_columns() -> dict:
    return spec(coords=[[*xy, 1.0] for xy in VALID["coords"]])


def vrplib_file(folder, s=None, edit=lambda text: text):
    s = s or spec()
    text = vrp_text(s["coords"], s["demand"], tw=s["windows"], service=s["service"], limit=s["limit"],
                    capacity=s["capacity"])
    return text_file(folder / "hostile.vrp", edit(text))


def token(value) -> str:
    """A value as a text file holds it: floats in full (nan, inf), anything else as written."""
    return repr(value) if isinstance(value, float) else str(value)


def solomon_file(folder, s=None, edit=lambda row: row):
    """Solomon's columns per node: number, x, y, demand, ready time, due date, service time; ``edit`` per row."""
    s = s or spec()
    rows = [" ".join(token(v) for v in [i, *xy, d, *tw, svc])
            for i, (xy, d, tw, svc) in enumerate(zip(s["coords"], s["demand"], s["windows"], s["service"]))]
    header = replaced(SOLOMON_HEADER, " 50\n", f" {token(s['capacity'])}\n")
    return write_solomon(folder, [edit(r) for r in rows], header=header, name="hostile.txt")


def json_file(folder, s=None, **replace):
    s = s or spec()
    obj = {"capacity": s["capacity"], "depot": s["coords"][0], "customers": s["coords"][1:], "demand": s["demand"][1:],
           "time_windows": s["windows"][1:], "service_times": s["service"][1:], "depot_close": s["windows"][0][1],
           "route_limit": s["limit"]}
    return text_file(folder / "hostile.json", json.dumps(obj | replace))


def unit_square(value):
    """File units -> the unit square of the paper's pickles and npz batches, leaving non-numbers as they are."""
    if isinstance(value, list):
        return [unit_square(v) for v in value]
    return value / 100 if type(value) in (int, float) else value


# The paper's VRPLTW tuple: depot [[x, y]], customers' [x, y], demands, capacity, route limit, service times,
# ready times, due dates (the depot's closing time is the paper's fixed 3).
ROW = ("depot", "customers", "demand", "capacity", "limit", "service", "ready", "due")


def paper_row(s: dict) -> list:
    u = {k: unit_square(v) for k, v in s.items() if k not in ("demand", "capacity")}
    return [u["coords"][:1], u["coords"][1:], s["demand"][1:], s["capacity"], u["limit"], u["service"][1:],
            [w[0] for w in u["windows"][1:]], [w[1] for w in u["windows"][1:]]]


def paper_file(folder, s=None, name="vrpltw3_uniform.pkl", **replace):
    row = paper_row(s or spec())
    for field, value in replace.items():
        row[ROW.index(field)] = value
    return bytes_file(folder / name, pickle.dumps([tuple(row)]))


def npz_file(folder, **changes):
    """The valid instance as a batch of one, written by save_npz; with ``changes`` (field -> function of its
    array) written by np.savez, as a file from elsewhere would be."""
    row = dict(zip(ROW, paper_row(spec())))
    batch = from_arrays(np.array(row["depot"]), np.array([row["customers"]]), np.array([row["demand"]]),
                        row["capacity"], variant="VRPLTW", route_limit=row["limit"],
                        service_time=np.array([row["service"]]), tw_start=np.array([row["ready"]]),
                        tw_end=np.array([row["due"]]))
    path = folder / "hostile.npz"
    if not changes:
        save_npz(path, batch)
        return path
    arrays = {name: np.array(getattr(batch, name)) for name in npz_io.FIELDS}
    arrays[npz_io.VERSION_KEY] = np.asarray(npz_io.FORMAT_VERSION, np.int64)
    arrays |= {field: change(arrays[field]) for field, change in changes.items()}
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def set_at(index, value) -> Callable:
    def change(arr):
        arr[index] = value
        return arr
    return change


INSTANCE_FILES = {"vrp": vrplib_file, "txt": solomon_file, "json": json_file, "npz": npz_file, "pkl": paper_file}


# ----------------------------------------------------------------------------------------------------
# Hostile instance files
# ----------------------------------------------------------------------------------------------------

# Per format: the fields it holds, each with how its errors name it (a regular expression).
FIELD_NAMES = {
    "vrp": {"coords": "NODE_COORD_SECTION", "demand": "DEMAND_SECTION", "capacity": "CAPACITY",
            "windows": "TIME_WINDOW_SECTION", "service": "SERVICE_TIME", "limit": "VEHICLES_MAX_DISTANCE"},
    "txt": {"coords": r"line \d+: x is", "demand": r"line \d+: demand is", "capacity": r"line \d+: the capacity is",
            "windows": r"line \d+: due_date is", "service": r"line \d+: service_time is"},
    "json": {"coords": "'customers'", "demand": "'demand'", "capacity": "'capacity'", "windows": "'time_windows'",
             "service": "'service_times'", "limit": "'route_limit'"},
    "pkl": {"coords": "in the node coordinates", "demand": "in the demands", "capacity": "in the capacity",
            "windows": "in the time window ends", "service": "in the service times", "limit": "in the route limit"},
    "npz": {"coords": "field 'locs'", "demand": "field 'demand'", "windows": "field 'tw_end'",
            "service": "field 'service_time'", "limit": "field 'route_limit'"},
}
NON_FINITE_PHRASE = {"vrp": "contains non-finite entries", "txt": "not a finite number", "json": "finite number",
                     "pkl": r"non-finite values \(NaN or infinity\)", "npz": "holds non-finite values"}
# Where customer 2's entry of a field sits in an npz batch of one.
NPZ_AT = {"coords": ("locs", (0, 2, 0)), "demand": ("demand", (0, 2)), "windows": ("tw_end", (0, 2)),
          "service": ("service_time", (0, 2)), "limit": ("route_limit", (0,))}


def non_finite_writer(fmt: str, field: str, value) -> Callable:
    if fmt == "npz":
        name, index = NPZ_AT[field]
        return lambda folder: npz_file(folder, **{name: set_at(index, value)})
    return lambda folder: INSTANCE_FILES[fmt](folder, with_value(field, value))


def non_finite_cases(fmt: str) -> list[Case]:
    """NaN, +inf and -inf in each field of the format, each error naming the field."""
    return [Case(fmt, "non-finite", f"{word}-in-{field}", non_finite_writer(fmt, field, value),
                 (label, NON_FINITE_PHRASE[fmt]))
            for field, label in FIELD_NAMES[fmt].items() for word, value in NON_FINITE.items()]


def spec_shape_cases(fmt: str, write: Callable, *, demand_short: str, coords_3_columns: str,
                     windows_short: str) -> list[Case]:
    """The demand and the time windows one node short, and coordinates of three columns, for a format written
    from an instance spec by ``write(folder, spec)``; each with the phrase its error must contain."""
    return [Case(fmt, "shape", "demand-one-short", lambda f: write(f, short("demand")), (demand_short,)),
            Case(fmt, "shape", "coords-of-3-columns", lambda f: write(f, three_columns()), (coords_3_columns,)),
            Case(fmt, "shape", "windows-one-short", lambda f: write(f, short("windows")), (windows_short,))]


def vrplib_edited(old: str, new: str) -> Callable:
    return lambda folder: vrplib_file(folder, edit=lambda text: replaced(text, old, new))


VRP_CASES = [
    *byte_damages("vrp", vrplib_file, text=True, truncated=r"missing [A-Z_ ()]+SECTION|not a readable VRPLIB file",
                  empty="empty file", random="not a readable VRPLIB file"),
    *non_finite_cases("vrp"),
    Case("vrp", "shape", "demand-one-short", lambda f: vrplib_file(f, short("demand")),
         (r"DEMAND_SECTION has 3 entries for 4 nodes",)),
    Case("vrp", "shape", "coords-of-3-columns", lambda f: vrplib_file(f, three_columns()),
         (r"NODE_COORD_SECTION must have 2 coordinates per node .* got shape \(4, 3\)",)),
    Case("vrp", "shape", "windows-of-1-column", lambda f: vrplib_file(f, spec(windows=[[0]] * 4)),
         (r"TIME_WINDOW_SECTION must give 'early late' for each of the 4 nodes",)),
    Case("vrp", "dtype", "text-in-demand", vrplib_edited("\n3 4.0\n", "\n3 many\n"),
         ("DEMAND_SECTION contains non-numeric entries",)),
    Case("vrp", "dtype", "boolean-coordinate", vrplib_edited("\n2 10.0 0.0\n", "\n2 True 0.0\n"),
         ("NODE_COORD_SECTION contains non-numeric entries",)),
    Case("vrp", "dtype", "text-capacity", vrplib_edited("CAPACITY : 30.0", "CAPACITY : lots"),
         ("CAPACITY contains non-numeric entries",)),
    Case("vrp", "attack", "dimension-claiming-10^12-nodes", vrplib_edited("DIMENSION : 4", f"DIMENSION : {10**12}"),
         (r"DIMENSION is 1000000000000 but NODE_COORD_SECTION has 4 nodes",)),
]

TXT_CASES = [
    *byte_damages("txt", solomon_file, text=True,
                  truncated=r"expected 7 columns|missing (VEHICLE|CUSTOMER) section|at least one customer",
                  empty="empty file", random="missing VEHICLE section"),
    *non_finite_cases("txt"),
    Case("txt", "shape", "rows-without-service-time", lambda f: solomon_file(f, edit=lambda r: r.rsplit(" ", 1)[0]),
         (r"line \d+: expected 7 columns .* got 6",)),
    Case("txt", "shape", "rows-with-a-third-coordinate", lambda f: solomon_file(f, three_columns()),
         (r"line \d+: expected 7 columns .* got 8",)),
    Case("txt", "dtype", "text-in-demand", lambda f: solomon_file(f, with_value("demand", "many")),
         (r"line \d+: demand is 'many', not a number",)),
    Case("txt", "dtype", "boolean-coordinate", lambda f: solomon_file(f, with_value("coords", True)),
         (r"line \d+: x is 'True', not a number",)),
    Case("txt", "dtype", "text-capacity", lambda f: solomon_file(f, with_value("capacity", "lots")),
         (r"line \d+: the capacity is 'lots', not a number",)),
]

JSON_CASES = [
    *byte_damages("json", json_file, text=True, truncated="not a JSON file", empty="not a JSON file",
                  random="not a JSON file"),
    *non_finite_cases("json"),
    *spec_shape_cases("json", json_file, demand_short=r"'demand' has 2 entries for 3 customers",
                      coords_3_columns=r"'depot' must be \[x, y\] and 'customers' a non-empty list of \[x, y\]",
                      windows_short=r"'time_windows' must give \[earliest, latest\] for each of the 3 customers"),
    Case("json", "dtype", "booleans-as-demand", lambda f: json_file(f, demand=[True, True, False]),
         (r"'demand' must be a list of numbers, found true",)),
    Case("json", "dtype", "text-coordinates", lambda f: json_file(f, customers=[["10", "0"], ["0", "20"], ["5", "5"]]),
         (r"'customers' must be a list of \[x, y\] of numbers, found \"10\"",)),
    Case("json", "dtype", "text-capacity", lambda f: json_file(f, capacity="30"),
         (r"'capacity' must be a finite number, got '30'",)),
    Case("json", "dtype", "null-service-time", lambda f: json_file(f, service_times=[1, None, 1]),
         (r"'service_times' must be a number or a list of numbers, found null",)),
    Case("json", "attack", "nested-100000-deep", lambda f: text_file(f / "deep.json", "[" * 100_000 + "]" * 100_000),
         ("nested too deeply",)),
]

PKL_CASES = [
    *byte_damages("pkl", paper_file, text=False, truncated=r"not a readable pickle data file .*truncated",
                  empty=r"not a readable pickle data file \(EOFError", random="not a readable pickle data file"),
    *non_finite_cases("pkl"),
    *spec_shape_cases("pkl", paper_file,
                      demand_short=r"node coordinates \(1, 3, 2\) and demands \(1, 2\) do not match",
                      coords_3_columns=r"node coordinates \(1, 3, 3\) and demands \(1, 3\) do not match",
                      windows_short=r"time window starts of shape \(1, 2\), expected \(1, 3\)"),
    Case("pkl", "dtype", "booleans-as-demand", lambda f: paper_file(f, demand=[True, True, False]),
         ("booleans where the demands should be numbers",)),
    Case("pkl", "dtype", "text-coordinates",
         lambda f: paper_file(f, customers=[["0.1", "0"], ["0", "0.2"], ["0", "0"]]),
         ("text where the node coordinates should be numbers",)),
    Case("pkl", "dtype", "complex-capacity", lambda f: paper_file(f, capacity=30 + 1j),
         ("complex numbers where the capacity should be numbers",)),
    Case("pkl", "dtype", "none-as-due-date", lambda f: paper_file(f, due=[0.5, None, 0.8]),
         (r"objects \(e\.g\. None or containers\) where the time window ends should be numbers",)),
    Case("pkl", "attack", "reduce-running-os.system",
         lambda f: bytes_file(f / "vrpltw3_uniform.pkl", pickle.dumps([(_Hostile(touch_marker(f)),)])),
         (r"refusing to load global \w+\.system",)),
    # A name that does not state the variant takes another path: the variant is read off the data first.
    Case("pkl", "attack", "reduce-running-os.system-in-an-unnamed-file",
         lambda f: bytes_file(f / "mine.pkl", pickle.dumps([(_Hostile(touch_marker(f)),)])),
         (r"refusing to load global \w+\.system",)),
    Case("pkl", "attack", "global-builtins.eval",
         lambda f: bytes_file(f / "vrpltw3_uniform.pkl", dumps([Call(Global("builtins", "eval"), eval_marker(f))])),
         (r"refusing to load global builtins\.eval",)),
    Case("pkl", "attack", "bytes-claiming-2^62-bytes",        # BINBYTES8 stating 2**62 bytes, then 3 bytes
         lambda f: bytes_file(f / "vrpltw3_uniform.pkl", b"\x80\x04\x8e" + (2**62).to_bytes(8, "little") + b"abc"),
         (r"not a readable pickle data file \((MemoryError|UnpicklingError)",)),
]

NPZ_CASES = [
    *byte_damages("npz", npz_file, text=False, truncated=r"not a readable \.npz file",
                  empty=r"not a readable \.npz file", random=r"not a readable \.npz file"),
    *non_finite_cases("npz"),
    Case("npz", "shape", "demand-one-short", lambda f: npz_file(f, demand=lambda a: a[:, :-1]),
         (r"field 'demand' has shape \(1, 3\), expected \(1, 4\)",)),
    Case("npz", "shape", "coords-of-3-columns",
         lambda f: npz_file(f, locs=lambda a: np.concatenate([a, a[..., :1]], -1)),
         (r"field 'locs' has shape \(1, 4, 3\), expected \(1, 4, 2\)",)),
    Case("npz", "shape", "flags-of-another-batch", lambda f: npz_file(f, has_tw=lambda a: np.repeat(a, 2)),
         (r"field 'has_tw' has shape \(2,\), expected \(1,\)",)),
    Case("npz", "dtype", "integer-coordinates", lambda f: npz_file(f, locs=lambda a: (a * 100).astype(np.int32)),
         (r"field 'locs' has dtype int32, expected float32",)),
    Case("npz", "dtype", "complex-demand", lambda f: npz_file(f, demand=lambda a: a.astype(np.complex64)),
         (r"field 'demand' has dtype complex64, expected float32",)),
    Case("npz", "dtype", "text-due-dates", lambda f: npz_file(f, tw_end=lambda a: a.astype(str)),
         (r"field 'tw_end' has dtype <U\d+, expected float32",)),
    Case("npz", "dtype", "integer-flag", lambda f: npz_file(f, has_tw=lambda a: a.astype(np.int8)),
         (r"field 'has_tw' has dtype int8, expected bool",)),
    Case("npz", "attack", "object-array-running-os.system",
         lambda f: npz_file(f, demand=lambda a: object_array_running_code(f)),
         (r"not a readable \.npz file of plain arrays .*Object arrays cannot be loaded",)),
    Case("npz", "attack", "npy-header-claiming-2.4TB", lambda f: _claims_huge_shape(f / "hostile.npz"),
         (r"member locs\.npy states shape \(100000000000, 3, 2\) of float32",)),
    Case("npz", "attack", "zip-entry-and-header-claiming-4GB",
         lambda f: npz_forged(f / "hostile.npz", "locs", (10**9,)),
         (r"member locs\.npy claims \d+ bytes uncompressed but stores \d+ without compression",)),
]

INSTANCE_CASES = VRP_CASES + TXT_CASES + JSON_CASES + PKL_CASES + NPZ_CASES


@pytest.mark.parametrize("fmt", list(INSTANCE_FILES))
def test_the_intact_instance_file_of_each_format_is_read(tmp_path, fmt):
    read, refused = inputs.read_inputs([INSTANCE_FILES[fmt](tmp_path)])
    variant = "VRPTW" if fmt == "txt" else "VRPLTW"        # Solomon's format has no route limit
    assert refused == [] and len(read) == 1 and read[0].variant == variant


@pytest.mark.parametrize("case", params(INSTANCE_CASES))
def test_a_hostile_instance_file_is_refused_naming_it_and_the_problem(tmp_path, case):
    path = case.write(tmp_path)
    read, refused = inputs.read_inputs([path])
    assert read == [] and [r.source for r in refused] == [str(path)]
    message = refused[0].error
    assert message.startswith(str(path)) and "\n" not in message and "Traceback" not in message
    for phrase in case.expect:
        assert re.search(phrase, message), (phrase, message)
    # The reader itself names the file, for its callers other than read_inputs (evaluate.py, the baselines).
    with pytest.raises(ValueError) as raised:
        inputs.read_file(str(path))
    assert str(path) in str(raised.value)
    assert not (tmp_path / MARKER).exists()


# ----------------------------------------------------------------------------------------------------
# A torch .pt checkpoint
# ----------------------------------------------------------------------------------------------------

def pomo_mtl_state(embedding: int = 8, hidden: int = 16) -> dict[str, np.ndarray]:
    """The state dict of a one-layer POMO-MTL, names and shapes as the reference implementation saves them
    (torch Linear weights are (out, in); the decoder's query reads 4 dynamic features besides the embedding)."""
    e, layer = embedding, "encoder.layers.0"
    shapes = {"encoder.embedding_depot.weight": (e, 2), "encoder.embedding_depot.bias": (e,),
              "encoder.embedding_node.weight": (e, 5), "encoder.embedding_node.bias": (e,),
              **{f"{layer}.{w}.weight": (e, e) for w in ("Wq", "Wk", "Wv")},
              f"{layer}.multi_head_combine.weight": (e, e), f"{layer}.multi_head_combine.bias": (e,),
              **{f"{layer}.addAndNormalization{k}.norm.{p}": (e,) for k in (1, 2) for p in ("weight", "bias")},
              f"{layer}.feedForward.W1.weight": (hidden, e), f"{layer}.feedForward.W1.bias": (hidden,),
              f"{layer}.feedForward.W2.weight": (e, hidden), f"{layer}.feedForward.W2.bias": (e,),
              "decoder.Wq_last.weight": (e, e + 4), "decoder.Wk.weight": (e, e), "decoder.Wv.weight": (e, e),
              "decoder.multi_head_combine.weight": (e, e), "decoder.multi_head_combine.bias": (e,)}
    rng = np.random.default_rng(0)
    return {name: rng.normal(0, 0.1, shape).astype(np.float32) for name, shape in shapes.items()}


STORAGE_KINDS = {np.dtype(np.float32): "FloatStorage", np.dtype(bool): "BoolStorage",
                 np.dtype(np.complex64): "ComplexFloatStorage"}
WEIGHT = "decoder.Wk.weight"


def pt_file(folder, state=None, numel=None):
    """``{"epoch", "model_state_dict"}`` as torch.save writes it; ``numel``: what every storage record claims."""
    state, obj, storages = pomo_mtl_state() if state is None else state, {}, {}
    for i, (name, value) in enumerate(state.items()):
        if isinstance(value, np.ndarray):
            obj[name] = tensor(Storage(STORAGE_KINDS[value.dtype], str(i), numel or value.size), 0, value.shape,
                               tuple(s // value.itemsize for s in value.strides))
            storages[str(i)] = value.tobytes()
        else:
            obj[name] = value
    return write_checkpoint(folder / "hostile.pt", {"epoch": 1, "model_state_dict": obj}, storages)


def pt_with(**entries) -> Callable:
    """A writer of the valid checkpoint with state dict ``entries`` replaced (None: removed)."""
    def write(folder):
        state = pomo_mtl_state() | entries
        return pt_file(folder, {k: v for k, v in state.items() if v is not None})
    return write


def pt_calling(module: str, name: str, argument: Callable) -> Callable:
    """A writer of a checkpoint whose data.pkl calls ``module.name(argument(folder))`` beside a tensor."""
    def write(folder):
        obj = {"model_state_dict": {"w": tensor(Storage("FloatStorage", "0", 2), 0, (2,), (1,)),
                                    "evil": Call(Global(module, name), argument(folder))}}
        return write_checkpoint(folder / "hostile.pt", obj, {"0": np.ones(2, np.float32).tobytes()})
    return write


def pt_with_forged_storage(folder):
    """A storage record of 10**9 floats whose zip entry is forged to state 4 GB to match; it holds 16 bytes."""
    path = pt_file(folder, {"w": np.zeros(4, np.float32)}, numel=10**9)
    forge_entry_size(path, "archive/data/0", 4 * 10**9)
    return path


def pt_with_short_data_pkl(folder):
    """An intact zip whose data.pkl lost its last bytes."""
    path = pt_file(folder)
    with zipfile.ZipFile(path) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    members["archive/data.pkl"] = members["archive/data.pkl"][:-8]
    with zipfile.ZipFile(path, "w") as archive:
        for n, data in members.items():
            archive.writestr(n, data)
    return path


PT_CASES = [
    *byte_damages("pt", pt_file, text=False, truncated="truncated or damaged zip archive", empty="empty file",
                  random="is not a zip archive"),
    Case("pt", "truncated", "data.pkl-truncated-in-an-intact-zip", pt_with_short_data_pkl, ("damaged data.pkl",)),
    *[Case("pt", "non-finite", f"{word}-in-a-weight", pt_with(**{WEIGHT: np.full((8, 8), value, np.float32)}),
           (rf"state dict entry '{re.escape(WEIGHT)}' holds non-finite values",))
      for word, value in NON_FINITE.items()],
    Case("pt", "shape", "weight-with-an-extra-column", pt_with(**{WEIGHT: np.zeros((8, 9), np.float32)}),
         ("does not fit model 'pomo_mtl'", r"shape mismatches: Wk/kernel: checkpoint \(9, 8\), model \(8, 8\)")),
    Case("pt", "shape", "weight-of-rank-1", pt_with(**{"encoder.embedding_depot.weight": np.zeros(16, np.float32)}),
         (r"shape mismatches: embedding_depot/kernel: checkpoint \(16,\), model \(2, 8\)",)),
    Case("pt", "shape", "weight-missing", pt_with(**{WEIGHT: None}), (rf"{re.escape(WEIGHT)} is missing",)),
    Case("pt", "dtype", "text-as-weight", pt_with(**{WEIGHT: "weights"}),
         (rf"'{re.escape(WEIGHT)}' is a str, not a tensor",)),
    Case("pt", "dtype", "boolean-weight", pt_with(**{WEIGHT: np.ones((8, 8), bool)}),
         ("tensor of bool, not of real numbers",)),
    Case("pt", "dtype", "complex-weight", pt_with(**{WEIGHT: np.ones((8, 8), np.complex64)}),
         ("tensor of complex64, not of real numbers",)),
    Case("pt", "attack", "global-os.system", pt_calling("os", "system", touch_marker),
         (r"refusing to load global os\.system",)),
    Case("pt", "attack", "global-builtins.eval", pt_calling("builtins", "eval", eval_marker),
         (r"refusing to load global builtins\.eval",)),
    Case("pt", "attack", "storage-record-claiming-2^40-floats",
         lambda f: pt_file(f, {"w": np.zeros(4, np.float32)}, numel=2**40),
         (r"storage '0' should hold 1099511627776 x float32",)),
    Case("pt", "attack", "zip-entry-claiming-4GB", pt_with_forged_storage,
         (r"archive/data/0 claims 4000000000 bytes uncompressed but stores 16",)),
]


def test_the_intact_torch_checkpoint_is_imported(tmp_path):
    cfg, loaded = checkpoints.load_policy(pt_file(tmp_path))
    assert (cfg.model, cfg.embedding_dim, cfg.num_layers, cfg.ff_hidden_dim) == ("pomo_mtl", 8, 1, 16)
    np.testing.assert_array_equal(loaded["params"]["Wk"]["kernel"], pomo_mtl_state()[WEIGHT].T)


@pytest.mark.parametrize("case", params(PT_CASES))
def test_a_hostile_torch_checkpoint_is_refused_naming_it_and_the_problem(tmp_path, case):
    path = case.write(tmp_path)
    with pytest.raises(ValueError) as raised:       # what the command lines report as "error: ..."
        checkpoints.load_policy(path)
    message = str(raised.value)
    assert str(path) in message
    for phrase in case.expect:
        assert re.search(phrase, message), (phrase, message)
    assert not (tmp_path / MARKER).exists()


# ----------------------------------------------------------------------------------------------------
# A shipped model's params.npz
# ----------------------------------------------------------------------------------------------------

SHIPPED_TINY = PolicyConfig(model="pomo_mtl", embedding_dim=8, num_heads=2, num_layers=1, ff_hidden_dim=16,
                            expert_loc=())
PARAM = "Wk/kernel"


def shipped_file(folder, **entries):
    """A shipped-models folder holding ``tiny`` (parameters of the model's shapes, no training needed);
    returns its params.npz, with ``entries`` (path -> array, a function of the folder, or None: removed)
    written over it by np.savez."""
    shapes = checkpoints.abstract_params(SHIPPED_TINY)
    flat = {"/".join(k): np.full(s.shape, 0.01, np.float32) for k, s in traverse_util.flatten_dict(shapes).items()}
    shipped.export(folder / "shipped" / "tiny", {"params": traverse_util.unflatten_dict(
        {tuple(k.split("/")): v for k, v in flat.items()})}, SHIPPED_TINY, {})
    path = folder / "shipped" / "tiny" / shipped.PARAMS_FILE
    if entries:
        flat |= {k: v(folder) if callable(v) else v for k, v in entries.items()}
        np.savez(path, **{k: v for k, v in flat.items() if v is not None})
    return path


def seal_card(params_path) -> None:
    """Record the file's checksum in its card, as a hostile package would, so that the reader's own checks are
    what refuses it."""
    card_path = params_path.parent / shipped.CARD_FILE
    card = json.loads(card_path.read_text())
    card_path.write_text(json.dumps(card | {"params_sha256": shipped.sha256(params_path)}))


SHIPPED_CASES = [
    *byte_damages("params.npz", shipped_file, text=False, truncated=r"not a readable \.npz file",
                  empty=r"not a readable \.npz file", random=r"not a readable \.npz file"),
    *[Case("params.npz", "non-finite", f"{word}-in-a-parameter",
           lambda f, value=value: shipped_file(f, **{PARAM: np.full((8, 8), value, np.float32)}),
           (r"parameters holding non-finite values \(NaN or infinity\): Wk/kernel",))
      for word, value in NON_FINITE.items()],
    Case("params.npz", "shape", "parameter-with-an-extra-column",
         lambda f: shipped_file(f, **{PARAM: np.zeros((8, 9), np.float32)}),
         (r"shape mismatches: Wk/kernel: checkpoint \(8, 9\), model \(8, 8\)",)),
    Case("params.npz", "shape", "parameter-missing", lambda f: shipped_file(f, **{PARAM: None}),
         (r"missing parameters \(1\): Wk/kernel",)),
    *[Case("params.npz", "dtype", f"{word}-parameter",
           lambda f, dtype=dtype: shipped_file(f, **{PARAM: np.zeros((8, 8), dtype)}),
           (r"parameters not float32: Wk/kernel",))
      for word, dtype in (("float64", np.float64), ("int32", np.int32), ("complex64", np.complex64), ("text", str))],
    Case("params.npz", "attack", "object-array-running-os.system",
         lambda f: shipped_file(f, **{PARAM: object_array_running_code}),
         (r"not a readable \.npz file of plain arrays .*Object arrays cannot be loaded",)),
    Case("params.npz", "attack", "npy-header-claiming-2.4TB", lambda f: _claims_huge_shape(shipped_file(f), PARAM),
         (r"member Wk/kernel\.npy states shape \(100000000000, 3, 2\)",)),
    Case("params.npz", "attack", "zip-entry-and-header-claiming-4GB",
         lambda f: npz_forged(shipped_file(f), PARAM, (10**9,)),
         (r"member Wk/kernel\.npy claims \d+ bytes uncompressed but stores \d+ without compression",)),
]


def test_the_intact_shipped_model_loads(tmp_path, monkeypatch):
    path = shipped_file(tmp_path)
    monkeypatch.setattr(shipped, "SHIPPED_DIR", path.parent.parent)
    cfg, loaded = checkpoints.load_policy("tiny")
    assert cfg == SHIPPED_TINY and np.all(np.asarray(loaded["params"]["Wk"]["kernel"]) == np.float32(0.01))


@pytest.mark.parametrize("case", params(SHIPPED_CASES))
def test_a_hostile_shipped_model_is_refused_naming_it_and_the_problem(tmp_path, monkeypatch, case):
    path = case.write(tmp_path)
    seal_card(path)
    monkeypatch.setattr(shipped, "SHIPPED_DIR", path.parent.parent)
    with pytest.raises(ValueError) as raised:
        checkpoints.load_policy("tiny")
    message = str(raised.value)
    assert "'tiny'" in message
    for phrase in case.expect:
        assert re.search(phrase, message), (phrase, message)
    assert not (tmp_path / MARKER).exists()


# ----------------------------------------------------------------------------------------------------
# An exported training state (python -m mvmoe_jax.portable_state import)
# ----------------------------------------------------------------------------------------------------

STATE_FILE = "state_00.npz"
META_FILE = portable_state.META_FILE


@pytest.fixture(scope="module")
def exported_state(tmp_path_factory):
    """The export, by the real exporter, of a checkpoint of a tiny POMO-MTL run (its initial state: no
    training is needed for the files to be valid)."""
    folder = tmp_path_factory.mktemp("run")
    config = tiny_config(folder / "run")
    config.model = model_config(model="pomo_mtl", embedding_dim=8, num_heads=1, num_layers=1, ff_hidden_dim=8,
                                expert_loc=())
    cfg, state = portable_state._template(config)
    with training_loop.checkpoint_manager(config.workdir) as mngr:
        training_loop.save_checkpoint(mngr, 1, state, cfg, {"config": config.to_dict(), "epoch": 1, "step": 2})
        mngr.wait_until_finished()
    portable_state.export_state(config.workdir, str(folder / "exported"))
    return folder / "exported"


@pytest.fixture
def carried(tmp_path, exported_state):
    """``tmp_path`` holding a copy of the valid export, ``exported_copy(tmp_path)``."""
    shutil.copytree(exported_state, exported_copy(tmp_path))
    return tmp_path


def exported_copy(folder):
    """The copy of the valid export that each test of this section starts from (the ``carried`` fixture)."""
    return folder / "carried"


def state_with(change: Callable) -> Callable:
    """A writer: the export with ``change(arrays, folder, key)`` applied to its state file's arrays, ``key``
    naming a parameter (a float32 leaf of several values)."""
    def write(folder):
        target = exported_copy(folder)
        leaves = json.loads((target / META_FILE).read_text())["leaves"]
        key = next(r["key"] for r in leaves if r["dtype"] == "float32" and np.prod(r["shape"]) > 1)
        with np.load(target / STATE_FILE) as f:
            arrays = dict(f)
        change(arrays, folder, key)
        with open(target / STATE_FILE, "wb") as f:
            np.savez(f, **arrays)
        return target
    return write


def set_leaf(make: Callable) -> Callable:
    """A state change putting ``make(array, folder)`` in place of the parameter's array."""
    def change(arrays, folder, key):
        arrays[key] = make(arrays[key], folder)
    return change


def meta_with(change: Callable) -> Callable:
    """A writer: the export with ``change(meta)`` applied to its meta.json."""
    def write(folder):
        path = exported_copy(folder) / META_FILE
        meta = json.loads(path.read_text())
        change(meta)
        path.write_text(json.dumps(meta))
        return path.parent
    return write


def state_file(make: Callable) -> Callable:
    """A writer: the export with its state file replaced by ``make(path)``."""
    return lambda folder: make(exported_copy(folder) / STATE_FILE).parent


STATE_CASES = [
    *byte_damages("state", exported_copy, text=False, truncated=r"state_00\.npz: not a readable \.npz file",
                  empty=r"state_00\.npz: not a readable \.npz file", random=r"state_00\.npz: not a readable \.npz file",
                  member=STATE_FILE, prefix="npz-"),
    *byte_damages("state", exported_copy, text=True, truncated=r"meta\.json: no readable exported training state",
                  empty=r"meta\.json: no readable exported training state",
                  random=r"meta\.json: no readable exported training state", member=META_FILE, prefix="meta-"),
    *[Case("state", "non-finite", f"npz-{word}-in-a-parameter",
           state_with(set_leaf(lambda a, f, value=value: np.full_like(a, value))),
           (r"state_00\.npz: leaf \.params.* holds non-finite values \(NaN or infinity\)",))
      for word, value in NON_FINITE.items()],
    Case("state", "shape", "npz-parameter-with-an-extra-axis", state_with(set_leaf(lambda a, f: a[..., None])),
         (r"state_00\.npz: leaf \.params.* is float32\[\d+, \d+, 1\], expected float32\[\d+, \d+\]",)),
    Case("state", "shape", "npz-parameter-missing", state_with(lambda arrays, f, key: arrays.pop(key)),
         (r"state_00\.npz: no array 'leaf_\d+' \(leaf \.params",)),
    Case("state", "shape", "meta-file-index-out-of-range", meta_with(lambda m: m["leaves"][0].update(file=7)),
         (r"meta\.json: malformed exported training state: 'leaves' must be .* an index into 'files'",)),
    Case("state", "dtype", "npz-float64-parameter", state_with(set_leaf(lambda a, f: a.astype(np.float64))),
         (r"state_00\.npz: leaf \.params.* is float64\[",)),
    Case("state", "dtype", "npz-text-parameter", state_with(set_leaf(lambda a, f: a.astype(str))),
         (r"state_00\.npz: leaf \.params.* is <U\d+\[",)),
    Case("state", "dtype", "meta-epoch-as-text", meta_with(lambda m: m["train_meta"].update(epoch="1")),
         (r"meta\.json: malformed .* 'epoch' and 'step' as non-negative integers, got '1'",)),
    Case("state", "dtype", "meta-leaves-not-a-list", meta_with(lambda m: m.update(leaves={"0": "leaf_0"})),
         (r"meta\.json: malformed .* 'leaves' must be a list",)),
    Case("state", "attack", "npz-object-array-running-os.system",
         state_with(set_leaf(lambda a, f: object_array_running_code(f))),
         (r"state_00\.npz: not a readable \.npz file of plain arrays .*Object arrays cannot be loaded",)),
    Case("state", "attack", "npz-header-claiming-2.4TB", state_file(lambda p: _claims_huge_shape(p, "leaf_1")),
         (r"state_00\.npz: member leaf_1\.npy states shape \(100000000000, 3, 2\)",)),
    Case("state", "attack", "npz-zip-entry-and-header-claiming-4GB",
         state_file(lambda p: npz_forged(p, "leaf_1", (10**9,))),
         (r"state_00\.npz: member leaf_1\.npy claims \d+ bytes uncompressed but stores",)),
    # The file named is the export's own, readable, but reached through a path: no path may leave the folder.
    Case("state", "attack", "meta-file-name-leading-out-of-the-folder",
         meta_with(lambda m: m.update(files=[f"../carried/{STATE_FILE}"])),
         (r"meta\.json: malformed .* 'files' must be a list of file names in the exported folder",)),
    Case("state", "attack", "meta-nested-100000-deep",
         lambda f: text_file(exported_copy(f) / META_FILE, "[" * 100_000 + "]" * 100_000).parent,
         (r"meta\.json: no readable exported training state \(RecursionError",)),
]


def import_command(in_dir, workdir, capsys) -> tuple[int, str]:
    """The exit status and the error output of ``python -m mvmoe_jax.portable_state import IN_DIR WORKDIR``."""
    status = portable_state.main(["import", str(in_dir), str(workdir)])
    return status, capsys.readouterr().err


def test_the_intact_export_is_imported(carried, capsys):
    status, err = import_command(exported_copy(carried), carried / "workdir", capsys)
    assert (status, err) == (0, "")
    with training_loop.checkpoint_manager(str(carried / "workdir")) as mngr:
        assert mngr.latest_step() == 1


@pytest.mark.parametrize("case", params(STATE_CASES))
def test_a_hostile_exported_state_is_refused_naming_the_file_and_the_problem(carried, capsys, case):
    in_dir = case.write(carried)
    status, err = import_command(in_dir, carried / "workdir", capsys)
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert str(in_dir) in err and "Traceback" not in err
    for phrase in case.expect:
        assert re.search(phrase, err), (phrase, err)
    assert not (carried / "workdir").exists()        # nothing was written
    assert not (carried / MARKER).exists()


# ----------------------------------------------------------------------------------------------------
# The matrix itself
# ----------------------------------------------------------------------------------------------------

ALL_CASES = INSTANCE_CASES + PT_CASES + SHIPPED_CASES + STATE_CASES
FORMATS = ("vrp", "txt", "json", "npz", "pkl", "pt", "params.npz", "state")


def test_every_format_meets_every_damage_kind_and_every_case_is_named_once():
    kinds: dict[str, set[str]] = {}
    for case in ALL_CASES:
        assert case.damage in DAMAGE_KINDS, case.id
        kinds.setdefault(case.fmt, set()).add(case.damage)
    assert sorted(kinds) == sorted(FORMATS)
    for fmt, found in kinds.items():
        # Solomon's text states no sizes and can name nothing to run: it has no attack of its own.
        assert found == set(DAMAGE_KINDS) - ({"attack"} if fmt == "txt" else set()), fmt
    ids = [case.id for case in ALL_CASES]
    assert len(ids) == len(set(ids))
