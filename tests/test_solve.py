"""python -m mvmoe_jax.solve and its library form: every input format, .sol files that round-trip through vrplib
and pass the checker at their stated cost, sampling never worse than greedy and reproducible, memory plans,
and a clear error for each kind of bad input.

Most tests use a small freshly initialised model (its routes are poor but, like any policy's, feasible); the
test on a CVRPLIB file larger than the training size uses the briefly trained n = 20 fixture from ../shared.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys

import jax
import numpy as np
import pytest
import vrplib

from mvmoe_jax import checker, execution, instances, rollout, shipped
from mvmoe_jax.io import read_vrplib, save_npz
from mvmoe_jax.nn.policy import Policy, PolicyConfig
from mvmoe_jax.solve import api, inputs, models, outputs, plot, search
from mvmoe_jax.solve.__main__ import main

from conftest import REPO_ROOT, require_shared

SMALL = PolicyConfig(model="mvmoe", embedding_dim=32, num_heads=4, num_layers=2, ff_hidden_dim=64,
                     expert_loc=("Enc0", "Enc1", "Dec"))
N = 20
SCALE = 100.0          # files are written in units of 1/100 of the unit square, to check the mapping back
SQUARE = np.array([[0, 0], [10, 0], [0, 20], [5, 5]], np.float64)      # a depot and 3 customers, for small files
OK_DEMAND = [0, 3, 4, 2]


@pytest.fixture(scope="module")
def small_params():
    return jax.jit(Policy(SMALL, execution.reference()).init)({"params": jax.random.key(1), "gating": jax.random.key(2)},
                                                               generated("CVRP", 1))


@pytest.fixture
def shipped_small(tmp_path, monkeypatch, small_params):
    """Two shipped models, trained (by their cards) at n = 20 and n = 100; the one for n = 20 is the small model."""
    root = tmp_path / "shipped"
    shipped.export(root / "small_n20", small_params, SMALL, {"config": {"problem_size": 20}})
    shipped.export(root / "small_n100", small_params, SMALL, {"config": {"problem_size": 100}})
    monkeypatch.setattr(shipped, "SHIPPED_DIR", root)
    return root


def generated(variant: str, count: int, seed: int = 0):
    """``count`` <= 8 generated instances of n = 20 (always drawn 8 at a time: one compilation for every test)."""
    return instances.take(instances.generate(jax.random.key(seed), 8, N, variant), np.arange(count))


# ----------------------------------------------------------------------------------------------------
# Writers of each format (plain text and plain pickle, not the code under test)
# ----------------------------------------------------------------------------------------------------

def vrp_text(coords, delivery, *, pickup=None, tw=None, service=None, limit=None, type_=None, capacity=30,
             extra="", extra_sections=""):
    """A VRPLIB file: coords (N, 2) depot first, per-node delivery / pickup / [early, late] / service."""
    n_nodes = len(coords)
    rows = lambda values: "".join(f"{i + 1} {' '.join(repr(float(v)) for v in np.atleast_1d(r))}\n"
                                  for i, r in enumerate(values))
    text = f"NAME : test\n{'TYPE : ' + type_ + chr(10) if type_ else ''}DIMENSION : {n_nodes}\n"
    text += f"EDGE_WEIGHT_TYPE : EUC_2D\nCAPACITY : {capacity}\n{extra}"
    if limit is not None:
        text += f"VEHICLES_MAX_DISTANCE : {limit!r}\n"
    text += "NODE_COORD_SECTION\n" + rows(coords)
    text += ("LINEHAUL_SECTION\n" if pickup is not None else "DEMAND_SECTION\n") + rows(delivery)
    if pickup is not None:
        text += "BACKHAUL_SECTION\n" + rows(pickup)
    if tw is not None:
        text += "TIME_WINDOW_SECTION\n" + rows(tw)
    if service is not None:
        text += "SERVICE_TIME_SECTION\n" + rows(service)
    return text + extra_sections + "DEPOT_SECTION\n1\n-1\nEOF\n"


def vrp_from_instance(inst, type_=None, **kw):
    """The VRPLIB text of one generated instance, in file units (x SCALE), raw demands (capacity 30)."""
    locs = np.asarray(inst.locs, np.float64) * SCALE
    demand = np.rint(np.asarray(inst.demand, np.float64) * 30)
    args = dict(type_=type_)
    if bool(inst.has_backhaul):
        args.update(pickup=np.maximum(-demand, 0), delivery=np.maximum(demand, 0))
    else:
        args.update(delivery=demand)
    if bool(inst.has_tw):
        args.update(tw=np.stack([inst.tw_start, inst.tw_end], -1) * SCALE, service=np.asarray(inst.service_time) * SCALE)
    if bool(inst.has_limit):
        args.update(limit=float(inst.route_limit) * SCALE)
    args.update(kw)
    return vrp_text(locs, **args)


def json_from_instance(inst, **extra):
    locs = np.asarray(inst.locs, np.float64) * SCALE
    obj = {"capacity": 30, "depot": locs[0].tolist(), "customers": locs[1:].tolist(),
           "demand": np.rint(np.asarray(inst.demand[1:], np.float64) * 30).tolist()}
    if bool(inst.has_tw):
        obj.update(time_windows=(np.stack([inst.tw_start[1:], inst.tw_end[1:]], -1) * SCALE).tolist(),
                   service_times=float(inst.service_time[1]) * SCALE, depot_close=float(inst.tw_end[0]) * SCALE)
    if bool(inst.has_limit):
        obj["route_limit"] = float(inst.route_limit) * SCALE
    if bool(inst.is_open):
        obj["open_routes"] = True
    if bool(inst.has_backhaul):
        obj["backhauls"] = instances.backhaul_rule_names(inst)[0]
    obj.update(extra)
    return obj


def solomon_from_instance(inst, name="S20"):
    locs = np.asarray(inst.locs, np.float64) * SCALE
    demand = np.rint(np.asarray(inst.demand, np.float64) * 30)
    ready, due, svc = (np.asarray(a, np.float64) * SCALE for a in (inst.tw_start, inst.tw_end, inst.service_time))
    head = f"{name}\n\nVEHICLE\nNUMBER     CAPACITY\n  25         30\n\nCUSTOMER\nCUST NO. XCOORD. YCOORD. DEMAND " \
           "READY TIME DUE DATE SERVICE TIME\n\n"
    return head + "".join(f"{i} {float(locs[i, 0])!r} {float(locs[i, 1])!r} {demand[i]:g} {float(ready[i])!r} "
                          f"{float(due[i])!r} {float(svc[i])!r}\n" for i in range(len(locs)))


def paper_pickle(path, batch, capacity=30.0):
    """The paper's format for VRPBLTW: (depot, nodes, demand, capacity, limit, service, tw_start, tw_end)."""
    rows = []
    for i in range(batch.locs.shape[0]):
        locs = np.asarray(batch.locs[i], np.float64)
        rows.append((locs[:1].tolist(), locs[1:].tolist(), (np.asarray(batch.demand[i, 1:]) * capacity).round().tolist(),
                     capacity, float(batch.route_limit[i]), np.asarray(batch.service_time[i, 1:]).tolist(),
                     np.asarray(batch.tw_start[i, 1:]).tolist(), np.asarray(batch.tw_end[i, 1:]).tolist()))
    with open(path, "wb") as f:
        pickle.dump(rows, f)
    return path


def write(path, text):
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------------------
# Reading every format
# ----------------------------------------------------------------------------------------------------

def test_every_format_reads_with_the_variant_its_data_shows(tmp_path):
    tw = jax.tree.map(lambda x: x[0], generated("OVRPBLTW", 1))
    files = {
        "vrp": write(tmp_path / "a.vrp", vrp_from_instance(tw, type_="OVRPBLTW")),
        "json": tmp_path / "b.json",
        "txt": write(tmp_path / "c.txt", solomon_from_instance(jax.tree.map(lambda x: x[0], generated("VRPTW", 1)))),
        "npz": tmp_path / "d.npz",
        "pkl": paper_pickle(tmp_path / "vrpbltw20_uniform.pkl", generated("VRPBLTW", 2)),
    }
    files["json"].write_text(json.dumps([json_from_instance(tw, name="mine", best_known=1.5),
                                         json_from_instance(jax.tree.map(lambda x: x[0], generated("VRPL", 1)))]))
    save_npz(files["npz"], generated("OVRPTW", 3))
    read, refused = inputs.read_inputs([tmp_path], num_instances=2)
    assert refused == []
    got = {p.name: p for p in read}
    assert sorted(got) == ["S20", "b-1", "d-0", "d-1", "mine", "test", "vrpbltw20_uniform-0", "vrpbltw20_uniform-1"]
    assert [got[k].variant for k in ("test", "mine", "b-1", "S20", "d-0", "vrpbltw20_uniform-0")] == \
        ["OVRPBLTW", "OVRPBLTW", "VRPL", "VRPTW", "OVRPTW", "VRPBLTW"]
    assert got["mine"].best_known == 1.5
    # The files' units come back: every field of the VRPLIB and JSON instances equals the generated one (the
    # extent of the instance differs from the unit square's, so compare distances and times via the scale).
    for name in ("test", "mine"):
        p = got[name]
        d_file = math.dist(p.coords[0], p.coords[5])
        d_unit = math.dist(np.asarray(p.instance.locs[0], np.float64), np.asarray(p.instance.locs[5], np.float64))
        assert d_unit * p.scale == pytest.approx(d_file, rel=1e-6)
        assert d_file == pytest.approx(SCALE * math.dist(tw.locs[0], tw.locs[5]), rel=1e-5)
        np.testing.assert_allclose(np.asarray(p.instance.tw_end) * p.scale, np.asarray(tw.tw_end) * SCALE, rtol=1e-5)
        np.testing.assert_allclose(float(p.instance.route_limit) * p.scale, float(tw.route_limit) * SCALE, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(p.instance.demand), np.asarray(tw.demand), atol=1e-6)


@pytest.mark.parametrize("close, limit, scale", [(45.0, None, 20.0), (300.0, None, 100.0), (None, 150.0, 50.0),
                                                 (90.0, 240.0, 80.0)])
def test_long_horizons_are_scaled_to_the_training_range(tmp_path, close, limit, scale):
    """SQUARE spans 20 units; a depot closing time or route limit beyond 3 x 20 sets the factor instead, so that
    the instance's horizon is no longer than the training data's (3), in VRPLIB and JSON files alike."""
    tw = None if close is None else [[0, close], [0, close], [0, close], [0, close]]
    vrp, vrp_meta = read_vrplib(write(tmp_path / "h.vrp", vrp_text(SQUARE, OK_DEMAND, tw=tw, limit=limit)))
    obj = {"capacity": 30, "depot": SQUARE[0].tolist(), "customers": SQUARE[1:].tolist(), "demand": OK_DEMAND[1:]}
    if close is not None:
        obj.update(time_windows=[[0, close]] * 3, depot_close=close)
    if limit is not None:
        obj["route_limit"] = limit
    write(tmp_path / "h.json", json.dumps(obj))
    [problem], refused = inputs.read_inputs([tmp_path / "h.json"])
    assert refused == []
    for inst, got_scale in ((vrp, vrp_meta.scale), (problem.instance, problem.scale)):
        assert got_scale == pytest.approx(scale)
        np.testing.assert_allclose(np.asarray(inst.locs).reshape(-1, 2)[2], [0, 20 / scale], rtol=1e-6)
        depot_close, route_limit = np.asarray(inst.tw_end).reshape(-1)[0], np.asarray(inst.route_limit).reshape(-1)[0]
        if close is not None:
            assert depot_close == pytest.approx(close / scale) and depot_close <= 3 + 1e-6
        if limit is not None:
            assert route_limit == pytest.approx(limit / scale) and route_limit <= 3 + 1e-6


def test_pyvrp_reads_the_same_vrplib_file(tmp_path):
    pyvrp = pytest.importorskip("pyvrp")
    # PyVRP 0.12 keeps times and distances as integers: integer data compares exactly.
    path = write(tmp_path / "same.vrp", vrp_text(SQUARE, [0, 3, 0, 2], pickup=[0, 0, 4, 0], limit=100.0,
                                                   tw=[[0, 200], [0, 50], [10, 90], [0, 80]], service=[0, 1, 2, 3],
                                                   type_="VRPBLTW"))
    ours, meta = read_vrplib(path)
    data = pyvrp.read(str(path))
    assert meta.variant == "VRPBLTW" and data.num_clients == 3
    for c, client in enumerate(data.clients(), 1):
        assert client.delivery[0] - client.pickup[0] == pytest.approx(float(ours.demand[0, c]) * 30, abs=1e-5)
        assert (client.tw_early, client.tw_late, client.service_duration) == pytest.approx(
            [float(getattr(ours, f)[0, c]) * meta.scale for f in ("tw_start", "tw_end", "service_time")], rel=1e-6)
    assert data.vehicle_type(0).max_distance == pytest.approx(float(ours.route_limit[0]) * meta.scale, rel=1e-6)
    assert data.vehicle_type(0).tw_late == pytest.approx(float(ours.tw_end[0, 0]) * meta.scale, rel=1e-6)


# A depot and 4 customers away from the origin (the per-axis minimum is not 0), with time windows and service.
TW_COORDS = np.array([[30, 40], [10, 45], [55, 20], [40, 70], [25, 25]], np.float64)
TW_DEMAND = [0, 3, 4, 2, 5]
TW_WINDOWS = [[0, 400], [0, 200], [50, 250], [0, 300], [100, 350]]
TW_SERVICE = [0, 10, 10, 10, 10]


def solomon_text(coords, demand, windows, service, name="T5", capacity=30):
    """A Solomon file of these per-node values, depot first."""
    head = f"{name}\n\nVEHICLE\nNUMBER     CAPACITY\n  25         {capacity}\n\nCUSTOMER\n" \
           "CUST NO. XCOORD. YCOORD. DEMAND READY TIME DUE DATE SERVICE TIME\n\n"
    return head + "".join(f"{i} {x:g} {y:g} {d:g} {a:g} {b:g} {s:g}\n"
                          for i, ((x, y), d, (a, b), s) in enumerate(zip(coords, demand, windows, service)))


def test_the_same_data_as_vrplib_and_as_solomon_gives_the_same_instance(tmp_path):
    vrp = write(tmp_path / "t5.vrp", vrp_text(TW_COORDS, TW_DEMAND, tw=TW_WINDOWS, service=TW_SERVICE, type_="VRPTW"))
    txt = write(tmp_path / "t5.txt", solomon_text(TW_COORDS, TW_DEMAND, TW_WINDOWS, TW_SERVICE))
    [a], [b] = inputs.read_file(str(vrp)), inputs.read_file(str(txt))
    assert (a.variant, a.scale, a.cost_convention) == (b.variant, b.scale, b.cost_convention) == ("VRPTW", 400 / 3,
                                                                                                  "dimacs")
    for name, x, y in zip(a.instance.__dataclass_fields__, jax.tree.leaves(a.instance), jax.tree.leaves(b.instance)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    np.testing.assert_array_equal(a.coords, TW_COORDS)
    np.testing.assert_array_equal(b.coords, TW_COORDS)
    # The shared rule: the per-axis minimum at 0, one factor for coordinates and times.
    np.testing.assert_allclose(np.asarray(a.instance.locs).min(0), 0, atol=1e-7)
    np.testing.assert_allclose(np.asarray(a.instance.locs)[3] * a.scale, TW_COORDS[3] - TW_COORDS.min(0), rtol=1e-6)


def test_vrplib_and_solomon_files_are_recognised_by_content_under_any_extension(tmp_path):
    """PyVRP names VRPLIB files .txt (E-n22-k4.txt); a Solomon file may be named .vrp, or anything."""
    named = {"E-n5.txt": vrp_text(SQUARE, OK_DEMAND, type_="CVRP"),
             "t5.vrp": solomon_text(TW_COORDS, TW_DEMAND, TW_WINDOWS, TW_SERVICE),
             "t5.instance": solomon_text(TW_COORDS, TW_DEMAND, TW_WINDOWS, TW_SERVICE, name="T5b")}
    for name, text in named.items():
        write(tmp_path / name, text)
    read, refused = inputs.read_inputs([tmp_path / name for name in named])
    assert refused == []
    got = {p.source.rsplit("/", 1)[-1]: p for p in read}
    assert (got["E-n5.txt"].name, got["E-n5.txt"].variant, got["E-n5.txt"].cost_convention) == ("test", "CVRP", "nint")
    for name in ("t5.vrp", "t5.instance"):
        assert (got[name].variant, got[name].num_customers, got[name].cost_convention) == ("VRPTW", 4, "dimacs")
    assert inputs.file_format(str(tmp_path / "E-n5.txt")) == "VRPLIB"
    assert inputs.file_format(str(tmp_path / "t5.vrp")) == "Solomon"
    # A file that is neither, under an unknown extension, is refused by name.
    write(tmp_path / "notes.md", "just some notes\n")
    [(bad)] = inputs.read_inputs([tmp_path / "notes.md"])[1]
    assert "notes.md: unknown format .md" in bad.error


def _independent_cost(coords, routes, convention):
    """Closed routes' cost from the depot (row 0 of coords) with each edge rounded (``nint``) or truncated to one
    decimal (``dimacs``), summed in whole units or tenths."""
    units = 0
    for route in routes:
        stops = [0, *route, 0]
        for a, b in zip(stops, stops[1:]):
            d = math.hypot(coords[a][0] - coords[b][0], coords[a][1] - coords[b][1])
            units += int(d + 0.5) if convention == "nint" else int(d * 10)
    return units if convention == "nint" else units / 10


def test_the_sol_cost_is_in_the_instance_s_own_convention(tmp_path, shipped_small, capsys):
    """CVRPLIB's EUC_2D files: edges rounded to integers; VRPLIB files with time windows and Solomon files: edges
    truncated to one decimal (DIMACS). The .sol states that cost, the summary keeps it beside the exact length,
    and the gap is taken from it."""
    cvrp, tw = (jax.tree.map(lambda x: x[0], generated(v, 1, seed=9)) for v in ("CVRP", "VRPTW"))
    folder = tmp_path / "in"
    folder.mkdir()
    write(folder / "cvrp.vrp", vrp_from_instance(cvrp).replace("NAME : test", "NAME : cvrp"))
    write(folder / "tw.vrp", vrp_from_instance(tw, type_="VRPTW").replace("NAME : test", "NAME : tw"))
    write(folder / "tw.txt", solomon_from_instance(tw, name="S20"))
    bks = write(tmp_path / "bks.json", json.dumps({"mine": {"cvrp": 900.0, "tw": 1500.0, "S20": 1500.0}}))
    out = tmp_path / "out"
    assert main([str(folder), f"--output={out}", f"--bks={bks}", "--batch_size=1", "--no_progress"]) == 0
    solved = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["instances"]}
    coords = {"cvrp": np.asarray(cvrp.locs, np.float64) * SCALE, "tw": np.asarray(tw.locs, np.float64) * SCALE}
    coords["S20"] = coords["tw"]
    for name, convention in (("cvrp", "nint"), ("tw", "dimacs"), ("S20", "dimacs")):
        sol = vrplib.read_solution(str(out / f"{name}.sol"))
        stated = _independent_cost(coords[name], sol["routes"], convention)
        assert sol["cost"] == pytest.approx(stated, abs=1e-9), name
        s = solved[name]
        assert (s["cost_convention"], s["convention_cost"]) == (convention, sol["cost"]), name
        exact = sum(math.dist(coords[name][a], coords[name][b]) for r in sol["routes"]
                    for a, b in zip([0, *r], [*r, 0]))
        assert s["cost"] == pytest.approx(exact, rel=1e-9) and s["cost"] != sol["cost"], name
        assert s["gap"] == pytest.approx((stated - s["best_known"]) / s["best_known"] * 100, rel=1e-9), name


# ----------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------

def _bad_files(tmp_path):
    """(file, phrase its error must contain) for each kind of bad input."""
    far_window = np.array([[0, 100], [0, 50], [0, 5], [0, 80]])          # node 3 is 20 away, its window closes at 5
    late_return = np.array([[0, 30], [0, 50], [0, 25], [0, 30]])         # node 3: back at 40 at the earliest
    cases = [
        ("garbage.vrp", "this is : not : a vrplib file\n\x01\n", "not a readable VRPLIB file"),
        ("nonnumeric.vrp", vrp_text(SQUARE, OK_DEMAND).replace("2 10.0 0.0", "2 10.0 x"), "non-numeric"),
        ("unknown_section.vrp", vrp_text(SQUARE, OK_DEMAND, extra_sections="WEIRD_SECTION\n1 2\n"),
         "unknown section(s) WEIRD_SECTION"),
        ("unknown_field.vrp", vrp_text(SQUARE, OK_DEMAND, extra="FOO : 3\n"), "unknown field(s) FOO"),
        ("over_capacity.vrp", vrp_text(SQUARE, [0, 3, 31, 2]), "demands exceed CAPACITY 30 at nodes [3]"),
        ("over_capacity_pickup.vrp", vrp_text(SQUARE, [0, 3, 0, 2], pickup=[0, 0, 40, 0]), "pickups exceed CAPACITY"),
        ("unreachable_window.vrp", vrp_text(SQUARE, OK_DEMAND, tw=far_window),
         "node 3: its time window closes at 5, before a vehicle from the depot can arrive (travel time 20)"),
        ("depot_closes.vrp", vrp_text(SQUARE, OK_DEMAND, tw=late_return),
         "node 3: a vehicle serving it is back at the depot at 40 at the earliest, after the depot closes at 30"),
        ("short_limit.vrp", vrp_text(SQUARE, OK_DEMAND, limit=30.0),
         "node 3: its round trip from the depot (40) is longer than the route limit 30"),
        ("short_limit_open.vrp", vrp_text(SQUARE, OK_DEMAND, limit=15.0, type_="OVRPL"),
         "node 3: the way from the depot (20) is longer than the route limit 15"),
        ("type_without_data.vrp", vrp_text(SQUARE, OK_DEMAND, type_="VRPTW"),
         "TYPE is VRPTW but the file has no TIME_WINDOW_SECTION"),
        ("service_without_windows.vrp", vrp_text(SQUARE, OK_DEMAND, service=[0, 1, 1, 1]), "service times without"),
        ("not_json.json", "{not json", "not a JSON file"),
        ("unknown_key.json", json.dumps({"capacity": 5, "depot": [0, 0], "customers": [[1, 1]], "demand": [1],
                                         "colour": "red"}), "unknown key(s) ['colour']"),
        ("over_capacity.json", json.dumps({"capacity": 5, "depot": [0, 0], "customers": [[1, 1], [2, 2]],
                                           "demand": [1, -6]}), "customer(s) [2] exceeds the capacity 5"),
        ("window.json", json.dumps({"capacity": 5, "depot": [0, 0], "customers": [[3, 4], [6, 8]], "demand": [1, 1],
                                    "time_windows": [[0, 9], [0, 9]], "depot_close": 30}),
         "customer 2: its time window closes at 9, before a vehicle from the depot can arrive (travel time 10)"),
        ("limit.json", json.dumps([{"capacity": 5, "depot": [0, 0], "customers": [[3, 4]], "demand": [1]},
                                   {"capacity": 5, "depot": [0, 0], "customers": [[3, 4], [6, 8]], "demand": [1, 1],
                                    "route_limit": 12}]),
         "instance 1: 1 customer(s) that no route can serve: customer 2: its round trip from the depot (20) is longer"),
        ("lkh_cvrp20_uniform.pkl", pickle.dumps([(4.5, [1, 2, 0, 3])]), "a solution file"),
        ("notes.md", "hello", "unknown format .md"),
    ]
    out = []
    for name, content, phrase in cases:
        path = tmp_path / name
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        out.append((path, phrase))
    # A batch whose second instance has a customer whose window closes before anyone can arrive.
    batch = generated("VRPTW", 2)
    batch = batch.replace(tw_end=batch.tw_end.at[1, 4].set(1e-3))
    save_npz(tmp_path / "unservable.npz", batch)
    out.append((tmp_path / "unservable.npz", "unservable.npz#1: 1 customer(s) that no route can serve: customer 4: its "
                                             "time window closes"))
    return out


def test_each_bad_input_is_refused_with_its_own_error_naming_the_file(tmp_path):
    cases = _bad_files(tmp_path)
    problems_read, refused = inputs.read_inputs([p for p, _ in cases] + [tmp_path / "absent.vrp"])
    assert problems_read == []
    errors = {r.source: r.error for r in refused}
    assert errors[str(tmp_path / "absent.vrp")].endswith("absent.vrp: no such file or folder")
    for path, phrase in cases:
        message = errors[str(path)]
        assert message.startswith(str(path)) and phrase in message, (path.name, message)
        assert "\n" not in message


def test_a_stated_variant_must_agree_with_the_data_and_decides_open_routes(tmp_path):
    path = write(tmp_path / "plain.vrp", vrp_text(SQUARE, OK_DEMAND))
    read, refused = inputs.read_inputs([path], problem="OVRP")
    assert refused == [] and read[0].variant == "OVRP"
    read, refused = inputs.read_inputs([path], problem="VRPTW")
    assert read == [] and "--problem=VRPTW but the data has no time windows" in refused[0].error
    with pytest.raises(ValueError, match="unknown VRP variant 'VRPX'"):
        inputs.read_inputs([path], problem="VRPX")


# ----------------------------------------------------------------------------------------------------
# The command on a folder: .sol files, summary, plots, refused files
# ----------------------------------------------------------------------------------------------------

def _replay(problem, routes):
    """The checker's verdict and cost (in the file's units) of routes (lists of customers) on a read problem."""
    flat = [c for r in routes for c in (*r, 0)]
    report = checker.check_route(problem.instance, flat)
    return report.feasible, report.cost * problem.scale


def test_the_command_solves_a_folder_writes_checked_sol_files_and_lists_the_bad(tmp_path, shipped_small, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    write(folder / "a.vrp", vrp_from_instance(jax.tree.map(lambda x: x[0], generated("VRPTW", 1, seed=1)), type_="VRPTW"))
    (folder / "b.json").write_text(json.dumps([json_from_instance(jax.tree.map(lambda x: x[i], generated(v, 1, seed=2)))
                                               for i, v in ((0, "VRPBL"), (0, "OVRPLTW"))]))
    write(folder / "c.txt", solomon_from_instance(jax.tree.map(lambda x: x[0], generated("VRPTW", 1, seed=3))))
    save_npz(folder / "d.npz", generated("OVRPB", 2, seed=4))
    paper_pickle(folder / "vrpbltw20_uniform.pkl", generated("VRPBLTW", 2, seed=5))
    write(folder / "bad.vrp", vrp_text(SQUARE, OK_DEMAND, extra_sections="WEIRD_SECTION\n1 2\n"))
    write(folder / "bad.json", json.dumps({"capacity": 5, "depot": [0, 0], "customers": [[1, 1]], "demand": [9]}))
    out = tmp_path / "out"
    code = main([str(folder), f"--output={out}", "--plot", "--no_progress"])
    captured = capsys.readouterr()
    assert code == 1                                        # two inputs refused, the rest solved
    assert "n = 20: model small_n20" in captured.out        # the shipped model closest in size
    assert "refused: " + str(folder / "bad.vrp") in captured.err and "WEIRD_SECTION" in captured.err
    assert "refused: " + str(folder / "bad.json") in captured.err and "exceeds the capacity" in captured.err

    summary = json.loads((out / "summary.json").read_text())
    assert sorted(r["source"] for r in summary["refused"]) == [str(folder / "bad.json"), str(folder / "bad.vrp")]
    solved = {s["name"]: s for s in summary["instances"]}
    assert sorted(solved) == ["S20", "b-0", "b-1", "d-0", "d-1", "test", "vrpbltw20_uniform-0", "vrpbltw20_uniform-1"]
    assert {k: solved[k]["variant"] for k in ("test", "b-0", "b-1", "S20", "d-0", "vrpbltw20_uniform-0")} == {
        "test": "VRPTW", "b-0": "VRPBL", "b-1": "OVRPLTW", "S20": "VRPTW", "d-0": "OVRPB", "vrpbltw20_uniform-0": "VRPBLTW"}
    problems_read = {p.name: p for p in inputs.read_inputs([folder])[0]}
    for name, s in solved.items():
        assert s["feasible"] and s["search"] == "greedy" and s["starts"] == 20
        sol = vrplib.read_solution(str(out / f"{name}.sol"))
        assert sol["routes"] == s["routes"]
        assert sol["cost"] == pytest.approx(s["convention_cost"], rel=1e-12)     # the file's own convention
        assert s["cost_convention"] == ("dimacs" if name in ("test", "S20") else "exact"), name
        served = sorted(c for r in sol["routes"] for c in r)
        assert served == list(range(1, N + 1)), name
        feasible, cost = _replay(problems_read[name], sol["routes"])
        assert feasible, name
        assert cost == pytest.approx(s["cost"], rel=1e-5), name
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        open_note = "# " + outputs.OPEN_ROUTES_NOTE in (out / f"{name}.sol").read_text().splitlines()
        assert open_note == solved[name]["variant"].startswith("O"), name
    assert "VRPBLTW" in captured.out and "checker" in captured.out      # the table


def test_nothing_is_written_for_a_route_the_checker_refuses(tmp_path, shipped_small, monkeypatch, capsys):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(json_from_instance(jax.tree.map(lambda x: x[0], generated("CVRP", 1, seed=6)))))
    real = checker.check_routes

    def broken(batch, routes):
        return [checker.RouteCheck(False, "capacity", 2, 7, c.cost) for c in real(batch, routes)]
    monkeypatch.setattr(api.checker, "check_routes", broken)
    code = main([str(path), f"--output={tmp_path / 'out'}", "--no_progress"])
    assert code == 1
    assert "the route fails the checker (capacity at position 2 (node 7)); nothing written" in capsys.readouterr().err
    assert not (tmp_path / "out" / "one.sol").exists()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    entry = summary["instances"][0]
    assert entry["feasible"] is False and entry["files"] == {} and entry["routes"] is None


def _classic(second_pickup):
    """SQUARE's three customers under the classic rule: one delivery of 3 at (10, 0), then pickups of 20 at (0, 20)
    and of ``second_pickup`` at (5, 5), capacity 30. The only delivery opens the only route its pickups may use."""
    return {"capacity": 30, "depot": SQUARE[0].tolist(), "customers": SQUARE[1:].tolist(),
            "demand": [3, -20, -second_pickup], "backhauls": "classic", "best_known": 50.0}


def test_an_instance_every_rollout_dead_ends_on_is_reported_unsolved_beside_the_solved(tmp_path, shipped_small, capsys):
    """Pickups of 20 and 20 with one delivery to open their route: each alone fits after it, both do not (40 on a
    capacity of 30), so no solution exists and every rollout ends stranded. Beside it, the same instance with a
    pickup of 5 solves: the batch goes on, the stranded one has no file, no gap and no cost."""
    write(tmp_path / "stuck.json", json.dumps(_classic(20)))
    write(tmp_path / "fine.json", json.dumps(_classic(5)))
    out = tmp_path / "out"
    assert main([str(tmp_path / "stuck.json"), str(tmp_path / "fine.json"), f"--output={out}", "--no_progress"]) == 1
    captured = capsys.readouterr()
    assert f"error: stuck: {api.NO_SOLUTION}; nothing written for it" in captured.err
    stuck_line = next(line for line in captured.out.splitlines() if line.startswith("stuck"))
    assert stuck_line.endswith("no solution found") and "50.0" in stuck_line
    assert "mean gap over 1 instance(s)" in captured.out
    assert not (out / "stuck.sol").exists() and (out / "fine.sol").exists()
    entries = {e["name"]: e for e in json.loads((out / "summary.json").read_text())["instances"]}
    assert entries["stuck"]["found"] is False and entries["stuck"]["gap"] is None
    assert entries["stuck"]["routes"] is None and entries["stuck"]["violation"] == api.NO_SOLUTION
    assert entries["fine"]["found"] is True and entries["fine"]["feasible"] is True
    routes = vrplib.read_solution(str(out / "fine.sol"))["routes"]
    assert sorted(v for r in routes for v in r) == [1, 2, 3]


def test_costs_below_a_best_known_value_and_a_file_cut_short_are_warned(tmp_path, shipped_small, capsys):
    """A Solomon file cut short (4 customers named C101, 100 customers in Solomon's set): C101's best-known value
    is not used, and the warning says why; a cost below a stated best-known value is warned with both values."""
    folder = tmp_path / "in"
    folder.mkdir()
    write(folder / "c101.txt", solomon_text(TW_COORDS, TW_DEMAND, TW_WINDOWS, TW_SERVICE, name="C101"))
    write(folder / "t5.txt", solomon_text(TW_COORDS, TW_DEMAND, TW_WINDOWS, TW_SERVICE, name="T5"))
    bks = write(tmp_path / "bks.json", json.dumps({"Set-Solomon": {"C101": 827.3, "T5": 5000.0}}))
    out = tmp_path / "out"
    assert main([str(folder), f"--output={out}", f"--bks={bks}", "--no_progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    summary = json.loads((out / "summary.json").read_text())
    solved = {s["name"]: s for s in summary["instances"]}
    assert solved["C101"]["best_known"] is None and solved["C101"]["gap"] is None
    cut = [line for line in err if line.startswith("warning: C101:")]
    assert len(cut) == 1 and "827.3" in cut[0] and "4 customers" in cut[0] and "100 customers" in cut[0]
    t5 = solved["T5"]
    assert t5["gap"] < 0
    below = [line for line in err if line.startswith("warning: T5:")]
    assert below == [f"warning: T5: cost {t5['convention_cost']:.6g} is below the best-known value 5000 "
                     f"({t5['gap']:+.2f} %); check that the file is complete and the value is this instance's"]
    assert summary["warnings"] == [line.removeprefix("warning: ") for line in cut + below]


def test_an_output_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    path = write(tmp_path / "one.json", json.dumps({"capacity": 5, "depot": [0, 0], "customers": [[3, 4]],
                                                    "demand": [1]}))
    taken = write(tmp_path / "taken", "a file\n")
    for output, where in ((taken, "is a file"), (taken / "below", f"is below the file {taken}")):
        assert main([str(path), f"--output={output}", "--no_progress"]) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [f"error: --output {output} {where}; give a folder for the .sol files and "
                                    "summary.json"]
    assert taken.read_text() == "a file\n"


@pytest.mark.parametrize("method", ["eas", "sgbs", "sgbs_eas"])
def test_a_search_whose_first_round_cannot_fit_compiles_nothing_and_returns_greedy(small_params, monkeypatch, method):
    def no_program(*args, **kwargs):
        raise AssertionError("a search program was compiled")
    for name in ("eas_program", "sgbs_program", "sampling_program"):
        monkeypatch.setattr(search.Decoder, name, no_program)
    batch = generated("CVRP", 2, seed=3)
    greedy = api.solve_instances(SMALL, small_params, batch)
    timed = api.solve_instances(SMALL, small_params, batch, search=method, time_limit=1e-6)
    assert [s.rounds for s in timed] == [0, 0]
    assert [(s.cost, s.routes) for s in timed] == [(s.cost, s.routes) for s in greedy]
    assert [s.depths for s in timed] == ([None, None] if method == "eas" else [0, 0])


def test_compilation_is_reported_apart_and_a_search_without_rounds_is_warned(tmp_path, shipped_small, capsys):
    """A time limit that leaves no room for a sampling round after greedy: the run says so in one line, and the
    compilation time (not counted in the limit) is reported apart from the search's. Informational lines come
    as soon as known, the progress names what runs, and the last line counts the PNGs."""
    path = tmp_path / "eight.json"
    path.write_text(json.dumps([json_from_instance(jax.tree.map(lambda x: x[i], generated("CVRP", 8, seed=10)))
                                for i in range(8)]))
    out, lines = tmp_path / "out", []
    report = api.solve(path, search="sampling", time_limit=1e-6, samples=2, output=str(out), log=lines.append,
                       progress=True)
    assert lines[0] == "n = 20: model small_n20" and lines[1].startswith("n=20 greedy: all 20 POMO starts")
    assert "compiling" in capsys.readouterr().err or report.compile_seconds == 0     # the bar names the stage
    assert [s.rounds for s in report.solutions] == [0] * 8
    assert list(report.plans) == ["n=20 greedy"]              # no round fits: the sampling program not compiled
    assert len(report.warnings) == 1 and report.warnings[0].startswith(
        "--search=sampling ran 0 rounds on 8 instance(s) (eight-0, eight-1, eight-2, ...): --time_limit=1e-06 s per "
        "instance left no room for one after greedy x8")
    assert f"compilation ({report.compile_seconds:.1f} s) is not counted in the limit" in report.warnings[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["search_seconds"] == pytest.approx(sum(s["seconds"] for s in summary["instances"]))
    assert summary["compile_seconds"] == pytest.approx(sum(s["compile_seconds"] for s in summary["instances"]))
    assert summary["warnings"] == report.warnings
    # The command: the warning on stderr, the last line with search and compilation apart and the PNGs counted.
    assert main([str(path), f"--output={out}", "--search=sampling", "--time_limit=1e-6", "--samples=2", "--plot",
                 "--no_progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("warning: --search=sampling ran 0 rounds on 8 instance(s)") == 1
    last = captured.out.strip().splitlines()[-1]
    assert " s (search " in last and "compilation" in last and last.endswith(
        f"wrote 8 .sol file(s), 8 PNG file(s) and {out / 'summary.json'}")


def test_an_open_route_sol_says_so_in_a_comment_that_vrplib_readers_skip(tmp_path):
    path = outputs.write_sol(str(tmp_path / "o.sol"), [[3, 1], [2]], 41.5, convention="nint", open_routes=True)
    lines = (tmp_path / "o.sol").read_text().splitlines()
    assert lines == ["Route #1: 3 1", "Route #2: 2", "Cost: 41.5", "# " + outputs.CONVENTION_NOTES["nint"],
                     "# " + outputs.OPEN_ROUTES_NOTE]
    assert vrplib.read_solution(path) == {"routes": [[3, 1], [2]], "cost": 41.5}
    pyvrp = pytest.importorskip("pyvrp")
    data = pyvrp.read(str(write(tmp_path / "o.vrp", vrp_text(SQUARE, OK_DEMAND))))
    assert [r.visits() for r in pyvrp.read_solution(path, data).routes()] == [[3, 1], [2]]


def _figure_of(tmp_path, variant, routes):
    """The plot of ``routes`` on a generated instance of ``variant`` (n = 20), read back from a JSON file."""
    path = tmp_path / f"{variant}.json"
    path.write_text(json.dumps(json_from_instance(jax.tree.map(lambda x: x[0], generated(variant, 1, seed=11)))))
    [problem] = inputs.read_file(str(path))
    solution = api.Solution(name=variant, source=str(path), variant=variant, num_customers=N, routes=routes,
                            cost=1.0, convention_cost=1.0, greedy_cost=1.0, best_known=None, gap=None,
                            feasible=True, violation=None, seconds=0.0, starts=N, search="greedy", rounds=0,
                            model="m")
    return plot.solution_figure(problem, solution)


def test_the_plot_names_customers_by_kind_only_with_backhauls_and_never_repeats_a_route_colour(tmp_path):
    labels = lambda fig: fig.axes[0].get_legend_handles_labels()[1]
    one_each = [[c] for c in range(1, N + 1)]
    assert "customer" in labels(_figure_of(tmp_path, "CVRP", one_each))
    assert not any("linehaul" in label for label in labels(_figure_of(tmp_path, "CVRP", one_each)))
    assert {"linehaul customer", "backhaul customer"} <= set(labels(_figure_of(tmp_path, "VRPB", [list(range(1, N + 1))])))
    for count in (5, 20, 27, 60):
        styles = plot.route_styles(count)
        assert len(set(styles)) == count and len({colour for colour, _ in styles}) == count
    many = [[c] for c in range(1, N + 1)] + [[c, c % N + 1] for c in range(1, 8)]     # 27 routes
    lines = _figure_of(tmp_path, "CVRP", many).axes[0].lines
    assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == 27


def test_without_a_checkpoint_the_command_uses_the_installed_shipped_model_or_says_what_is_required(tmp_path):
    """The installation as a user has it: with models shipped, the closest in size solves; without, a clear error."""
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"capacity": 5, "depot": [0, 0], "customers": [[3, 4], [6, 8]], "demand": [1, 2]}))
    env = dict(os.environ, MVMOE_JAX_HUGE_PAGES="0")
    res = subprocess.run([sys.executable, "-m", "mvmoe_jax.solve", str(path), f"--output={tmp_path / 'out'}",
                          "--no_progress"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    if not shipped.names():
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().splitlines() == [
            "error: --checkpoint is required: no models ship with this installation yet (shipped models: none); "
            "give an orbax checkpoint, a training workdir or an original .pt file"]
        return
    assert res.returncode == 0, res.stderr
    assert f"n = 2: model {models.closest_shipped(2)}" in res.stdout
    (entry,) = json.loads((tmp_path / "out" / "summary.json").read_text())["instances"]
    assert entry["feasible"] and sorted(c for r in entry["routes"] for c in r) == [1, 2]
    # The cost in the file's units, recomputed from the coordinates (closed routes: back to the depot).
    points = {0: (0, 0), 1: (3, 4), 2: (6, 8)}
    cost = sum(math.dist(points[a], points[b]) for r in entry["routes"] for a, b in zip([0, *r], [*r, 0]))
    assert entry["cost"] == pytest.approx(cost, rel=1e-5)


def test_while_no_model_ships_the_checkpoint_is_required(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "none")
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"capacity": 5, "depot": [0, 0], "customers": [[3, 4]], "demand": [1]}))
    assert main([str(path), f"--output={tmp_path / 'out'}"]) == 2
    assert "error: --checkpoint is required: no models ship with this installation yet (shipped models: none)" \
        in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_search_choices_are_the_implemented_ones(capsys):
    with pytest.raises(SystemExit) as err:
        main(["x.vrp", "--search=beam"])
    assert err.value.code == 2
    assert "invalid choice: 'beam' (choose from 'greedy', 'sampling', 'eas', 'sgbs', 'sgbs_eas')" \
        in capsys.readouterr().err.replace('"', "'")


def test_the_closest_shipped_model_is_chosen(shipped_small):
    assert models.closest_shipped(20) == "small_n20"
    assert models.closest_shipped(70) == "small_n100"
    assert models.closest_shipped(1000) == "small_n100"


# ----------------------------------------------------------------------------------------------------
# Search: sampling never worse than greedy, reproducible; memory plans
# ----------------------------------------------------------------------------------------------------

def test_sampling_never_returns_worse_than_greedy_and_repeats_exactly_by_seed(small_params):
    batch = generated("OVRPBLTW", 8, seed=7)
    greedy = api.solve_instances(SMALL, small_params, batch)
    first = api.solve_instances(SMALL, small_params, batch, search="sampling", rounds=2, samples=2, seed=3)
    again = api.solve_instances(SMALL, small_params, batch, search="sampling", rounds=2, samples=2, seed=3)
    for g, s, t in zip(greedy, first, again):
        assert g.feasible and s.feasible and s.rounds == 2 and s.samples == 2 and g.samples is None
        assert s.greedy_cost == pytest.approx(g.cost, rel=1e-12)
        assert s.cost <= g.cost
        assert (t.cost, t.routes) == (s.cost, s.routes)
    assert any(s.cost < g.cost for g, s in zip(greedy, first))          # it does find better routes
    # Routes and costs as stated: the checker agrees.
    for i, s in enumerate(first):
        report = checker.check_route(jax.tree.map(lambda x: x[i], batch), [c for r in s.routes for c in (*r, 0)])
        assert report.feasible and report.cost == pytest.approx(s.cost, rel=1e-5)
    # A time limit too short for one round leaves greedy's routes.
    short = api.solve_instances(SMALL, small_params, batch, search="sampling", time_limit=1e-6, samples=2)
    assert [s.rounds for s in short] == [0] * 8 and [s.cost for s in short] == [g.cost for g in greedy]
    assert [s.samples for s in short] == [1] * 8


def test_the_local_search_after_a_search_is_checked_never_worse_and_reported(tmp_path, shipped_small, capsys):
    path = tmp_path / "b.json"
    path.write_text(json.dumps([json_from_instance(jax.tree.map(lambda x: x[i], generated(v, 1, seed=8)))
                                for i, v in ((0, "VRPBLTW"), (0, "OVRPL"))]))
    out = tmp_path / "out"
    assert main([str(path), f"--output={out}", "--improve=ls", "--no_progress"]) == 0
    captured = capsys.readouterr().out
    assert "local search: 2 of 2 solution(s) improved" in captured
    summary = json.loads((out / "summary.json").read_text())
    assert summary["improve"] == "ls"
    problems_read = {p.name: p for p in inputs.read_inputs([path])[0]}
    for s in summary["instances"]:
        assert s["improve"] == "ls" and s["improve_seconds"] > 0
        assert s["cost"] < s["searched_cost"] <= s["greedy_cost"] * (1 + 1e-12)
        feasible, cost = _replay(problems_read[s["name"]], vrplib.read_solution(str(out / f"{s['name']}.sol"))["routes"])
        assert feasible and cost == pytest.approx(s["cost"], rel=1e-5)
    with pytest.raises(SystemExit):
        main([str(path), "--improve=2opt", "--no_progress"])
    assert "invalid choice: '2opt'" in capsys.readouterr().err


def test_a_round_holds_fewer_samples_where_the_time_limit_is_short():
    """Sampled rollouts per start and copy in a round: as asked without a time limit or where a round of them
    fits after greedy (a sampled rollout costing 1.5 greedy ones), else as many as fit, at least one."""
    asked = search.Settings(samples=8)
    assert search.round_samples(asked, greedy_seconds=4.5, real=64) == 8
    # 0.5 s for each of 64 instances: 27.5 s left after greedy, a sample per start and copy costs 6.75 s.
    assert search.round_samples(search.Settings(samples=8, time_limit=0.5), greedy_seconds=4.5, real=64) == 4
    assert search.round_samples(search.Settings(samples=8, time_limit=2.0), greedy_seconds=4.5, real=64) == 8
    assert search.round_samples(search.Settings(samples=8, time_limit=0.05), greedy_seconds=4.5, real=64) == 1


def test_a_time_limited_sampling_run_repeats_from_its_reported_rounds_and_samples(small_params):
    """Far more samples asked than 0.5 s an instance holds: rounds of fewer, the first of which always starts
    (greedy takes a few hundredths of that here); the reported rounds and samples, without the time limit, repeat
    the run."""
    batch = generated("VRPTW", 6, seed=2)
    timed = api.solve_instances(SMALL, small_params, batch, search="sampling", time_limit=0.5, samples=10_000, seed=5)
    rounds, samples = timed[0].rounds, timed[0].samples
    assert all((s.rounds, s.samples) == (rounds, samples) for s in timed)
    assert rounds >= 1 and 1 <= samples < 10_000
    again = api.solve_instances(SMALL, small_params, batch, search="sampling", rounds=rounds, samples=samples, seed=5)
    assert [(s.cost, s.routes) for s in again] == [(s.cost, s.routes) for s in timed]


class _FakeCompiled:
    def __init__(self, chunk, starts):
        self.chunk, self.starts = chunk, starts

    def memory_bytes(self):
        return 1000 + 100 * self.chunk * self.starts


def test_a_program_too_large_for_memory_decodes_fewer_copies_then_fewer_starts():
    fit = lambda budget: search.fit_to_memory(_FakeCompiled, rows=16, starts=20, chunk=16, budget=budget,
                                             num_customers=20)[1]
    assert (fit(10**6).chunk, fit(10**6).starts) == (16, 20)
    plan = fit(20000)                          # 8 copies of 20 starts fit
    assert plan.starts == 20 and plan.chunk <= 9 and plan.memory_bytes <= 20000
    plan = fit(1500)                           # one copy at a time, and fewer starts
    assert plan.chunk == 1 and plan.starts <= 5 and plan.memory_bytes <= 1500
    assert plan.describe().startswith(f"{plan.starts} of 20 POMO starts, 1 of 16")
    with pytest.raises(ValueError, match="needs .* GiB to decode even one start"):
        fit(500)


def test_a_memory_budget_changes_the_chunks_not_the_routes(small_params):
    batch = generated("VRPLTW", 8, seed=8)
    free = api.solve_instances(SMALL, small_params, batch)
    _, plan, _ = search.Decoder(SMALL, small_params).greedy_program(batch)
    one_copy = rollout.compile_greedy_evaluate(SMALL, small_params, batch, jax.random.key(0), pomo_size=N,
                                               chunk_size=1).memory_bytes()
    assert plan.chunk > 1 and one_copy < plan.memory_bytes
    constrained = api.solve_instances(SMALL, small_params, batch, memory_budget=one_copy)
    _, tight, _ = search.Decoder(SMALL, small_params, search.Settings(memory_budget=one_copy)).greedy_program(batch)
    assert tight.chunk < plan.chunk and tight.starts == N and tight.memory_bytes <= one_copy
    assert [s.routes for s in constrained] == [s.routes for s in free]


def test_a_cvrplib_instance_five_times_the_training_size_solves_with_fewer_starts(tmp_path):
    paper = require_shared("data", "mvmoe-paper")
    ckpt = require_shared("fixtures", "torch-reference", "checkpoints", "moe_n20_fixture.pt")
    path = paper / "CVRP-LIB" / "X-n101-k25.vrp"
    report = api.solve([path], checkpoint=str(ckpt), max_starts=10, bks=str(paper / "BKS.json"), output=str(tmp_path))
    s = report.solutions[0]
    assert report.plans["n=100 greedy"].startswith("10 of 100 POMO starts")
    assert s.feasible and s.starts == 10 and s.best_known == 27591
    # The rounded cost from the raw file and the .sol routes, independently of the code under test.
    xy = vrplib.read_instance(str(path))["node_coord"]
    sol = vrplib.read_solution(str(tmp_path / "X-n101-k25.sol"))
    rounded = sum(math.floor(math.dist(xy[a], xy[b]) + 0.5) for r in sol["routes"] for a, b in zip([0, *r], [*r, 0]))
    assert s.cost_convention == "nint" and s.convention_cost == pytest.approx(rounded, abs=1e-6)
    assert s.gap == pytest.approx((rounded - 27591) / 27591 * 100)
    assert sol["cost"] == pytest.approx(rounded, abs=1e-6) and abs(s.cost - rounded) < 0.5 * 150
