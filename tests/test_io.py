"""Data input/output: npz round trips, CVRPLIB and Solomon readers, BKS table, the paper's pickles.

Expected values are computed here from the raw files with small independent parsers (plain text
splitting, and plain ``pickle`` for the trusted fixture), never through the code under test.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex

import jax
import numpy as np
import pytest

from mvmoe_jax import env, instances, problems
from mvmoe_jax.io import (DataFileNotFoundError, UnsafePickleError, load_bks, load_npz, load_paper_instances,
                          read_solomon, read_vrplib, save_npz)
from mvmoe_jax.io import npz as npz_io
from mvmoe_jax.io import safe_pickle

FIELDS = npz_io.FIELDS


# ----------------------------------------------------------------------------------------------------
# Helpers and fixtures
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def paper(shared_dir):
    return shared_dir / "data" / "mvmoe-paper"


@pytest.fixture(scope="session")
def fixture_pkl(shared_dir):
    return shared_dir / "fixtures" / "torch-reference" / "data" / "VRPBLTW" / "vrpbltw20_uniform.pkl"


def _as_numpy(inst):
    return {name: np.asarray(getattr(inst, name)) for name in FIELDS}


def assert_instances_identical(a, b):
    """Every field equal bit for bit (NaN-free data, so array_equal with inf is exact), same dtype."""
    na, nb = _as_numpy(a), _as_numpy(b)
    for name in FIELDS:
        assert na[name].dtype == nb[name].dtype, name
        assert na[name].shape == nb[name].shape, name
        assert np.array_equal(na[name], nb[name]), name


def pairwise(xy):
    xy = np.asarray(xy, np.float64)
    return np.sqrt(((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1))


def raw_vrp(path):
    """Independent minimal parse of a Set-X file: (coords (N, 2), demand (N,), capacity)."""
    lines = [ln.split() for ln in open(path)]
    spec = {ln[0].rstrip(":"): ln[-1] for ln in lines if len(ln) >= 2 and ":" in " ".join(ln)}
    dim, capacity = int(spec["DIMENSION"]), float(spec["CAPACITY"])
    start = {ln[0]: k for k, ln in enumerate(lines) if ln and ln[0].endswith("_SECTION")}
    coord = np.array([[float(v) for v in ln[1:3]] for ln in lines[start["NODE_COORD_SECTION"] + 1:][:dim]])
    demand = np.array([float(ln[1]) for ln in lines[start["DEMAND_SECTION"] + 1:][:dim]])
    return coord, demand, capacity


def raw_solomon(path):
    """Independent minimal parse of a Solomon file: (table (N, 7), num_vehicles, capacity)."""
    rows = [ln.split() for ln in open(path)]
    numeric = [r for r in rows if r and all(t.replace(".", "", 1).isdigit() for t in r)]
    vehicles, capacity = numeric[0]
    table = np.array([[float(t) for t in r] for r in numeric[1:]])
    return table, int(vehicles), float(capacity)


VRP_TEMPLATE = {
    "head": "NAME : tiny\nTYPE : CVRP\nDIMENSION : {dim}\nEDGE_WEIGHT_TYPE : {ewt}\n",
    "capacity": "CAPACITY : 10\n",
    "coords": "NODE_COORD_SECTION\n1 0 0\n2 10 0\n3 0 20\n4 5 5\n",
    "demand": "DEMAND_SECTION\n1 0\n2 3\n3 4\n4 {d4}\n",
    "depot": "DEPOT_SECTION\n{depots}\n-1\n",
}


def write_vrp(tmp_path, *, dim=4, ewt="EUC_2D", d4=2, depots="1", drop=(), name="tiny.vrp"):
    parts = {k: v.format(dim=dim, ewt=ewt, d4=d4, depots=depots) for k, v in VRP_TEMPLATE.items()}
    text = "".join(v for k, v in parts.items() if k not in drop) + "EOF\n"
    path = tmp_path / name
    path.write_text(text)
    return path


SOLOMON_HEADER = ("TINY\n\nVEHICLE\nNUMBER     CAPACITY\n  3          50\n\nCUSTOMER\n"
                  "CUST NO.  XCOORD.   YCOORD.    DEMAND   READY TIME  DUE DATE   SERVICE   TIME\n\n")
SOLOMON_ROWS = [
    "0   0   0    0    0   100   0",
    "1  10   0   10    0    50   5",
    "2   0  20   20   10    60   5",
    "3  20  20    5    0    80   5",
]


def write_solomon(tmp_path, rows=SOLOMON_ROWS, header=SOLOMON_HEADER, name="tiny.txt"):
    path = tmp_path / name
    path.write_text(header + "\r\n".join(rows) + "\r\n")
    return path


# ----------------------------------------------------------------------------------------------------
# npz
# ----------------------------------------------------------------------------------------------------

def test_npz_round_trip_all_variants(tmp_path):
    batch = instances.generate(jax.random.PRNGKey(0), 32, 20, problems.VARIANT_NAMES)
    assert not np.all(np.isfinite(np.asarray(batch.route_limit)))     # some +inf limits to preserve
    path = tmp_path / "batch.npz"
    save_npz(path, batch)
    assert_instances_identical(load_npz(path), batch)


def test_npz_round_trip_paper_fixture_compressed_and_exact_name(tmp_path, fixture_pkl):
    batch = load_paper_instances(fixture_pkl)
    path = tmp_path / "sub" / "no_suffix"       # missing parent is created; no ".npz" appended
    save_npz(path, batch, compressed=True)
    assert path.is_file() and not (tmp_path / "sub" / "no_suffix.npz").exists()
    assert_instances_identical(load_npz(path), batch)


def _write_fields(path, arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _valid_arrays():
    arrays = _as_numpy(instances.generate(jax.random.PRNGKey(1), 3, 20, "VRPLTW"))
    arrays[npz_io.VERSION_KEY] = np.asarray(npz_io.FORMAT_VERSION, np.int64)
    return arrays


@pytest.mark.parametrize("field", ["tw_end", "has_tw", "locs"])
def test_npz_missing_field(tmp_path, field):
    arrays = _valid_arrays()
    del arrays[field]
    _write_fields(tmp_path / "x.npz", arrays)
    with pytest.raises(ValueError, match=field):
        load_npz(tmp_path / "x.npz")


@pytest.mark.parametrize("field, bad, problem", [
    ("demand", lambda a: a[:, :-1], "shape"),                 # node count differs from locs
    ("is_open", lambda a: a[:-1], "shape"),                   # batch size differs from locs
    ("route_limit", lambda a: a.astype(np.float64), "dtype"),
    ("has_limit", lambda a: a.astype(np.int32), "dtype"),
])
def test_npz_mismatched_field(tmp_path, field, bad, problem):
    arrays = _valid_arrays()
    arrays[field] = bad(arrays[field])
    _write_fields(tmp_path / "x.npz", arrays)
    with pytest.raises(ValueError, match=f"'{field}'.*{problem}"):
        load_npz(tmp_path / "x.npz")


@pytest.mark.parametrize("field, index", [("locs", (1, 5, 0)), ("tw_end", (2, 3)), ("route_limit", (0,))])
def test_npz_rejects_nan(tmp_path, field, index):
    arrays = _valid_arrays()
    arrays[field] = arrays[field].copy()
    arrays[field][index] = np.nan
    _write_fields(tmp_path / "x.npz", arrays)
    with pytest.raises(ValueError, match=f"'{field}' holds non-finite values \\(first at index {re.escape(str(index))}"):
        load_npz(tmp_path / "x.npz")


def test_npz_refuses_pickled_objects_and_bad_versions(tmp_path):
    arrays = _valid_arrays()
    arrays["locs"] = np.array([object()], dtype=object)
    _write_fields(tmp_path / "obj.npz", arrays)
    with pytest.raises(ValueError, match="plain arrays"):
        load_npz(tmp_path / "obj.npz")

    arrays = _valid_arrays()
    del arrays[npz_io.VERSION_KEY]
    _write_fields(tmp_path / "nover.npz", arrays)
    with pytest.raises(ValueError, match="format_version"):
        load_npz(tmp_path / "nover.npz")

    arrays = _valid_arrays()
    arrays[npz_io.VERSION_KEY] = np.asarray(99)
    _write_fields(tmp_path / "v99.npz", arrays)
    with pytest.raises(ValueError, match="unsupported format version"):
        load_npz(tmp_path / "v99.npz")

    arrays = _valid_arrays()
    arrays["extra"] = np.zeros(3)
    _write_fields(tmp_path / "extra.npz", arrays)
    with pytest.raises(ValueError, match="unknown key"):
        load_npz(tmp_path / "extra.npz")


def _claims_huge_shape(path, name="locs"):
    """An .npz whose one member's header states a (10**11, 3, 2) float32 array (2.4 TB) but holds 16 bytes."""
    import io as bytes_io
    import zipfile

    member = bytes_io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False, "shape": (10**11, 3, 2)})
    member.write(np.zeros(4, np.float32).tobytes())
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}.npy", member.getvalue())
    return path


def test_npz_claiming_a_huge_array_is_refused_before_numpy_allocates_it(tmp_path):
    """Instances, shipped parameters and carried training state alike: the member and its stated shape named."""
    from mvmoe_jax import shipped

    path = _claims_huge_shape(tmp_path / "huge.npz")
    with pytest.raises(ValueError, match=r"huge.npz: member locs.npy states shape \(100000000000, 3, 2\) of "
                                         r"float32 \(2400000000000 bytes\) but holds \d+ bytes"):
        load_npz(path)
    with pytest.raises(ValueError, match="member locs.npy states shape"):
        shipped.read_params(path)


def test_npz_garbage_missing_and_unbatched(tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"definitely not a zip archive")
    with pytest.raises(ValueError, match="junk.npz"):
        load_npz(tmp_path / "junk.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(ValueError, match="not an .npz archive"):
        load_npz(tmp_path / "one.npy")
    with pytest.raises(ValueError, match="no such file"):
        load_npz(tmp_path / "absent.npz")
    single = instances.take(instances.generate(jax.random.PRNGKey(2), 2, 20, "CVRP"), 0)
    with pytest.raises(ValueError, match="batched"):
        save_npz(tmp_path / "single.npz", single)


# ----------------------------------------------------------------------------------------------------
# CVRPLIB (Set X) and BKS
# ----------------------------------------------------------------------------------------------------

def test_read_every_set_x_file(paper):
    files = sorted((paper / "CVRP-LIB").glob("*.vrp"))
    assert len(files) == 28
    bks = load_bks(paper / "BKS.json", section="Set-X")
    for path in files:
        inst, meta = read_vrplib(path)
        coord, demand, capacity = raw_vrp(path)
        n = coord.shape[0] - 1
        locs = np.asarray(inst.locs, np.float64)
        assert locs.shape == (1, n + 1, 2) and inst.demand.shape == (1, n + 1), path.name
        assert meta.name == path.stem and meta.num_customers == n and meta.capacity == capacity
        assert problems.variant_from_flags(*np.asarray(inst.flags)[0]).name == "CVRP"
        assert np.isinf(np.asarray(inst.route_limit)).all()
        # Unit square, touched on both ends of the longer axis.
        assert locs.min() >= 0 and locs.max() <= 1
        np.testing.assert_allclose(locs[0].min(0), 0, atol=1e-7)
        assert abs((locs[0].max(0) - locs[0].min(0)).max() - 1) < 1e-6
        # Demands normalised by capacity; depot 0.
        np.testing.assert_allclose(np.asarray(inst.demand)[0], demand / capacity, rtol=1e-6)
        assert float(inst.demand[0, 0]) == 0 and float(inst.demand.max()) <= 1
        # scale recovers the raw distances (float32 coordinates: ~1e-7 relative to the extent).
        rows = np.r_[0, 1, n // 2, n]
        np.testing.assert_allclose(pairwise(locs[0])[rows] * meta.scale, pairwise(coord)[rows],
                                   rtol=0, atol=1e-6 * meta.scale, err_msg=path.name)
        np.testing.assert_allclose(meta.offset, coord.min(0))
        assert meta.name in bks                  # every file has its entry in the paper's BKS table


def test_read_vrplib_fixed_scale(paper):
    path = paper / "CVRP-LIB" / "X-n101-k25.vrp"
    inst, meta = read_vrplib(path, loc_scale=1000)
    coord, _, _ = raw_vrp(path)
    assert meta.scale == 1000 and meta.offset == (0.0, 0.0)
    np.testing.assert_allclose(np.asarray(inst.locs)[0], coord / 1000, rtol=1e-6)
    with pytest.raises(ValueError, match="loc_scale"):
        read_vrplib(path, loc_scale=500)


@pytest.mark.parametrize("kwargs, message", [
    (dict(ewt="EXPLICIT"), "EDGE_WEIGHT_TYPE is 'EXPLICIT'"),
    (dict(drop=("capacity",)), "missing CAPACITY"),
    (dict(drop=("demand",)), "missing DEMAND_SECTION"),
    (dict(drop=("depot",)), "missing DEPOT_SECTION"),
    (dict(drop=("coords",)), "missing NODE_COORD_SECTION"),
    (dict(depots="2"), "depot is node 2"),
    (dict(depots="1\n2"), "2 depots"),
    (dict(d4=11), "exceed CAPACITY"),
    (dict(dim=5), "DIMENSION is 5"),
])
def test_read_vrplib_errors(tmp_path, kwargs, message):
    path = write_vrp(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=message) as err:
        read_vrplib(path)
    assert str(path) in str(err.value)


def test_an_explicit_matrix_file_is_refused_for_its_edge_weight_type(tmp_path):
    """A file of EXPLICIT distances (EDGE_WEIGHT_FORMAT, EDGE_WEIGHT_SECTION) is refused for what it is, not for
    the fields that come with it."""
    path = tmp_path / "matrix.vrp"
    path.write_text("NAME : matrix\nTYPE : CVRP\nDIMENSION : 3\nEDGE_WEIGHT_TYPE : EXPLICIT\n"
                    "EDGE_WEIGHT_FORMAT : FULL_MATRIX\nCAPACITY : 10\nEDGE_WEIGHT_SECTION\n0 1 2\n1 0 3\n2 3 0\n"
                    "DEMAND_SECTION\n1 0\n2 1\n3 1\nDEPOT_SECTION\n1\n-1\nEOF\n")
    with pytest.raises(ValueError) as err:
        read_vrplib(path)
    message = str(err.value)
    assert message.startswith(f"{path}: EDGE_WEIGHT_TYPE is 'EXPLICIT'") and "only EUC_2D" in message
    assert "unknown field" not in message and "unknown section" not in message


def test_read_vrplib_tiny_and_malformed(tmp_path):
    inst, meta = read_vrplib(write_vrp(tmp_path))
    assert meta.scale == 20 and meta.offset == (0.0, 0.0) and meta.num_customers == 3
    np.testing.assert_allclose(np.asarray(inst.locs)[0], [[0, 0], [0.5, 0], [0, 1], [0.25, 0.25]])
    np.testing.assert_allclose(np.asarray(inst.demand)[0], [0, 0.3, 0.4, 0.2], rtol=1e-6)

    bad = tmp_path / "nonnumeric.vrp"
    bad.write_text(write_vrp(tmp_path).read_text().replace("2 10 0", "2 10 x"))
    with pytest.raises(ValueError, match="non-numeric"):
        read_vrplib(bad)
    garbage = tmp_path / "garbage.vrp"
    garbage.write_text("this is : not : a vrplib file\n\x01\n")
    with pytest.raises(ValueError, match="garbage.vrp"):
        read_vrplib(garbage)
    with pytest.raises(ValueError, match="no such file") as err:
        read_vrplib(tmp_path / "absent.vrp")
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, DataFileNotFoundError)


def test_load_bks(paper, tmp_path):
    table = load_bks(paper / "BKS.json")
    assert table["X-n101-k25"] == 27591 and table["R101"] == 1637.7
    assert set(load_bks(paper / "BKS.json", section="Set-Solomon")) < set(table)
    assert "source" not in table
    with pytest.raises(ValueError, match="no section 'Set-Y'"):
        load_bks(paper / "BKS.json", section="Set-Y")
    (tmp_path / "dup.json").write_text('{"A": {"x": 1}, "B": {"x": 2}}')
    with pytest.raises(ValueError, match="more than one section"):
        load_bks(tmp_path / "dup.json")
    (tmp_path / "str.json").write_text('{"A": {"x": "12"}}')
    with pytest.raises(ValueError, match="not a finite number"):
        load_bks(tmp_path / "str.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON file"):
        load_bks(tmp_path / "bad.json")


# ----------------------------------------------------------------------------------------------------
# Solomon
# ----------------------------------------------------------------------------------------------------

def test_read_every_solomon_file(paper):
    files = sorted((paper / "Vrp-Set-Solomon").glob("*.txt"))
    assert len(files) == 56
    bks = load_bks(paper / "BKS.json", section="Set-Solomon")
    for path in files:
        inst, meta = read_solomon(path)
        table, vehicles, capacity = raw_solomon(path)
        n = table.shape[0] - 1
        xy, demand, ready, due, service = table[:, 1:3], table[:, 3], table[:, 4], table[:, 5], table[:, 6]
        locs = np.asarray(inst.locs, np.float64)[0]
        assert locs.shape == (n + 1, 2) and n == 100 == meta.num_customers, path.name
        assert (meta.name, meta.num_vehicles, meta.capacity) == (path.stem, vehicles, capacity)
        assert problems.variant_from_flags(*np.asarray(inst.flags)[0]).name == "VRPTW"
        assert locs.min() >= 0 and locs.max() <= 1
        # The rule shared with the VRPLIB reader: the per-axis minimum subtracted, one factor for coordinates and
        # times, the depot closing by 3.
        extent = (xy.max(0) - xy.min(0)).max()
        np.testing.assert_array_equal(meta.offset, xy.min(0))
        assert meta.scale == pytest.approx(max(extent, due[0] / 3), rel=1e-12)
        assert float(inst.tw_end[0, 0]) <= 3 * (1 + 1e-6)
        assert locs.max() == pytest.approx(1) or float(inst.tw_end[0, 0]) == pytest.approx(3)
        np.testing.assert_allclose(np.asarray(inst.demand)[0], demand / capacity, rtol=1e-6)
        np.testing.assert_allclose(pairwise(locs)[[0, 1, n]] * meta.scale, pairwise(xy)[[0, 1, n]],
                                   rtol=0, atol=1e-6 * meta.scale, err_msg=path.name)
        # Times share the distance scale; the depot's due date is its closing time.
        for field, raw in (("tw_start", ready), ("tw_end", due), ("service_time", service)):
            np.testing.assert_allclose(np.asarray(getattr(inst, field))[0] * meta.scale, raw, rtol=1e-6,
                                       atol=1e-4, err_msg=f"{path.name} {field}")
        assert meta.name in bks or meta.name[:2] in ("C1", "C2", "R2")   # BKS.json lists R1/RC1/RC2


def test_solomon_round_trips_feasible_under_env(paper):
    """The reader's check, done by hand: depot -> i -> depot for every i of one instance."""
    inst, _ = read_solomon(paper / "Vrp-Set-Solomon" / "R101.txt")
    single = instances.take(inst, 0)
    for i in (1, 50, 100):
        state = env.reset(single)
        assert bool(env.action_mask(state)[i])
        state = env.step(state, i)
        assert bool(env.action_mask(state)[0])
        state = env.step(state, 0)
        assert float(state.time) == 0


def test_read_solomon_tiny(tmp_path):
    """The depot's due date (100) over 3 exceeds the largest coordinate (20), so it sets the factor."""
    inst, meta = read_solomon(write_solomon(tmp_path))
    assert meta.scale == pytest.approx(100 / 3) and meta.num_vehicles == 3 and meta.capacity == 50
    np.testing.assert_allclose(np.asarray(inst.tw_end)[0], [3, 1.5, 1.8, 2.4], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inst.tw_start)[0], [0, 0, 0.3, 0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inst.service_time)[0], [0, 0.15, 0.15, 0.15], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inst.locs)[0, 3], [0.6, 0.6], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inst.demand)[0], [0, 0.2, 0.4, 0.1])


def test_read_solomon_short_horizon_and_fixed_scale(tmp_path):
    """With the depot due at 54 (< 3 x 20) the largest coordinate sets the factor; loc_scale overrides both."""
    rows = [SOLOMON_ROWS[0].replace("100", "54")] + SOLOMON_ROWS[1:3] + ["3  20   0    5    0    50   5"]
    inst, meta = read_solomon(write_solomon(tmp_path, rows=rows))
    assert meta.scale == 20
    np.testing.assert_allclose(np.asarray(inst.tw_end)[0], [2.7, 2.5, 3, 2.5], rtol=1e-6)
    inst, meta = read_solomon(write_solomon(tmp_path, rows=rows), loc_scale=40)
    assert meta.scale == 40 and float(inst.tw_end[0, 0]) == pytest.approx(54 / 40)


def _replace_row(k, row):
    rows = list(SOLOMON_ROWS)
    rows[k] = row
    return rows


@pytest.mark.parametrize("kwargs, message", [
    (dict(header=SOLOMON_HEADER.replace("VEHICLE\n", "")), "missing VEHICLE"),
    (dict(header=SOLOMON_HEADER.replace("CUSTOMER\n", "")), "missing CUSTOMER"),
    (dict(rows=_replace_row(2, "2   0  20   20   10    60")), "expected 7 columns"),
    (dict(rows=_replace_row(2, "2   0  20   20   ten   60   5")), "'ten', not a number"),
    (dict(rows=_replace_row(2, "2   0  20   20   70    60   5")), "due date before ready time"),
    (dict(rows=_replace_row(2, "5   0  20   20   10    60   5")), "out of sequence"),
    (dict(rows=_replace_row(2, "2   0  20   60   10    60   5")), "above the capacity"),
    (dict(rows=_replace_row(0, "0   0   0    0    5   100   0")), "the depot"),
    # Customer 2 is 20 away from the depot but due at 15: unreachable in time.
    (dict(rows=_replace_row(2, "2   0  20   20    0    15   5")), r"customer\(s\) \[2\] cannot be served"),
    # Customer 3 (28.3 away) is reachable, but served from 70, it cannot be back before 70 + 5 + 28.3 > 100.
    (dict(rows=_replace_row(3, "3  20  20    5   70    80   5")), r"customer\(s\) \[3\] cannot be served"),
])
def test_read_solomon_errors(tmp_path, kwargs, message):
    path = write_solomon(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=message) as err:
        read_solomon(path)
    assert str(path) in str(err.value)


def test_read_solomon_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_solomon(tmp_path / "absent.txt")


# ----------------------------------------------------------------------------------------------------
# The paper's pickles
# ----------------------------------------------------------------------------------------------------

class _Hostile:
    """Unpickling this would run a shell command (it only creates a marker file)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_hostile_pickle_refused_and_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps([(_Hostile(f"touch {shlex.quote(str(marker))}"),)], protocol=4)
    path = tmp_path / "cvrp20_uniform.pkl"
    path.write_bytes(payload)
    with pytest.raises(UnsafePickleError, match="system"):
        load_paper_instances(path)
    with pytest.raises(UnsafePickleError):
        safe_pickle.loads(payload)
    assert not marker.exists()


def test_truncated_and_garbage_pickles(tmp_path, fixture_pkl):
    data = fixture_pkl.read_bytes()
    truncated = tmp_path / "vrpbltw20_uniform.pkl"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable pickle"):
        load_paper_instances(truncated)
    garbage = tmp_path / "cvrp20_uniform.pkl"
    garbage.write_bytes(b"\x00\x01 this is not a pickle \xff" * 10)
    with pytest.raises(ValueError, match="not a readable pickle"):
        load_paper_instances(garbage)
    with pytest.raises(FileNotFoundError):
        load_paper_instances(tmp_path / "cvrp50_uniform.pkl")


def test_wrong_field_count_for_variant(tmp_path, fixture_pkl):
    with pytest.raises(ValueError, match="has 8 fields, but a CVRP instance has 4"):
        load_paper_instances(fixture_pkl, "CVRP")
    rows = [([[0.5, 0.5]], [[0.1, 0.2], [0.3, 0.4]], [1.0, 2.0], 30.0)]
    path = tmp_path / "vrptw2_uniform.pkl"
    path.write_bytes(pickle.dumps(rows, protocol=4))
    with pytest.raises(ValueError, match="has 4 fields, but a VRPTW instance has 7"):
        load_paper_instances(path)
    assert load_paper_instances(path, "CVRP").locs.shape == (1, 3, 2)


def test_unknown_variant(tmp_path, fixture_pkl):
    with pytest.raises(problems.UnknownVariantError, match="VRPX"):
        load_paper_instances(fixture_pkl, "VRPX")
    path = tmp_path / "foovrp20_uniform.pkl"
    path.write_bytes(fixture_pkl.read_bytes())
    with pytest.raises(problems.UnknownVariantError):
        load_paper_instances(path)
    plain = tmp_path / "data.pkl"
    plain.write_bytes(fixture_pkl.read_bytes())
    with pytest.raises(ValueError, match="cannot tell the variant"):
        load_paper_instances(plain)


def test_load_paper_instances_fixture(fixture_pkl):
    with open(fixture_pkl, "rb") as f:       # a trusted fixture: plain pickle is fine for the expectation
        raw = pickle.load(f)
    depot = np.array([r[0] for r in raw], np.float64).reshape(-1, 1, 2)
    nodes = np.array([r[1] for r in raw], np.float64)
    demand = np.array([r[2] for r in raw], np.float64)
    capacity = np.array([r[3] for r in raw], np.float64)
    limit = np.array([r[4] for r in raw], np.float64)
    service, tw_start, tw_end = (np.array([r[k] for r in raw], np.float64) for k in (5, 6, 7))

    inst = load_paper_instances(fixture_pkl)
    batch, n = len(raw), nodes.shape[1]
    assert (batch, n) == (100, 20)
    assert inst.locs.shape == (batch, n + 1, 2)
    for field in ("demand", "service_time", "tw_start", "tw_end"):
        assert getattr(inst, field).shape == (batch, n + 1), field
    assert inst.route_limit.shape == (batch,)
    flags = np.asarray(inst.flags)
    assert (flags == [False, True, True, True]).all()               # VRPBLTW: not open; B, L, TW
    np.testing.assert_array_equal(np.asarray(inst.locs), np.concatenate([depot, nodes], 1).astype(np.float32))
    got_demand = np.asarray(inst.demand)
    np.testing.assert_array_equal(got_demand[:, 0], 0)
    np.testing.assert_allclose(got_demand[:, 1:], demand / capacity[:, None], rtol=1e-6)
    assert (got_demand < 0).any() and np.abs(got_demand).max() <= 1
    np.testing.assert_allclose(np.asarray(inst.route_limit), limit)
    np.testing.assert_allclose(np.asarray(inst.service_time)[:, 1:], service, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inst.tw_start)[:, 1:], tw_start, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inst.tw_end)[:, 1:], tw_end, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(inst.tw_end)[:, 0], 3.0)
    np.testing.assert_array_equal(np.asarray(inst.tw_start)[:, 0], 0.0)
    np.testing.assert_array_equal(np.asarray(inst.service_time)[:, 0], 0.0)

    part = load_paper_instances(fixture_pkl, num_instances=5, offset=10)
    assert_instances_identical(part, instances.take(inst, slice(10, 15)))
