"""evaluate.py on CVRPLIB / Solomon files: feasible routes, costs in the files' own units, gaps to BKS."""

import json
import math
import shutil
import types

import numpy as np
import pytest
import vrplib

from mvmoe_jax import cli
from configs import pomo_mtl


def _solomon_xy(path):
    rows = [line.split() for line in open(path) if line.split() and line.split()[0].isdigit()]
    table = [r for r in rows if len(r) == 7]
    return np.array([[float(r[1]), float(r[2])] for r in table])


def test_vrplib_and_solomon_evaluation(paper_dir, torch_fixtures, tmp_path):
    files = [paper_dir / "CVRP-LIB" / "X-n101-k25.vrp", paper_dir / "Vrp-Set-Solomon" / "RC101.txt"]
    for f in files:
        shutil.copy(f, tmp_path)
    flags = types.SimpleNamespace(
        checkpoint=str(torch_fixtures / "checkpoints" / "mtl_n20_fixture.pt"), vrplib_dir=str(tmp_path),
        bks=str(paper_dir / "BKS.json"), aug=8, batch_size=None, pomo_size=None, num_instances=None,
        seed=0, progress=False, data_dir=None, problems="ALL", size=50, reference=None)
    res = cli.run_evaluation(pomo_mtl.get_config(), flags)
    bks = json.loads((paper_dir / "BKS.json").read_text())
    assert set(res) == {"X-n101-k25", "RC101"}

    # CVRPLIB convention: every edge rounded to the nearest integer, in the file's coordinates.
    x = res["X-n101-k25"]
    xy = vrplib.read_instance(str(files[0]))["node_coord"]
    seq = [0] + x["route"] + [0]
    expected = sum(math.floor(math.dist(xy[a], xy[b]) + 0.5) for a, b in zip(seq, seq[1:]))
    assert x["obj"] == pytest.approx(expected, abs=1e-6)
    assert sorted(v for v in x["route"] if v) == list(range(1, 101))
    assert x["gap"] == pytest.approx((x["obj"] - bks["Set-X"]["X-n101-k25"]) / bks["Set-X"]["X-n101-k25"] * 100)
    assert x["obj"] >= bks["Set-X"]["X-n101-k25"]

    # Solomon: every edge truncated to one decimal (DIMACS, the convention of its best-known values), file units.
    s = res["RC101"]
    xy = _solomon_xy(files[1])
    seq = [0] + s["route"] + [0]
    expected = sum(math.floor(10 * math.dist(xy[a], xy[b])) for a, b in zip(seq, seq[1:])) / 10
    assert s["obj"] == pytest.approx(expected, abs=1e-9) and s["cost_convention"] == "dimacs"
    assert s["obj"] >= 1619.8 * (1 - 1e-6)     # RC101's best known solution


def test_vrplib_dir_without_files(torch_fixtures, tmp_path):
    flags = types.SimpleNamespace(
        checkpoint=str(torch_fixtures / "checkpoints" / "mtl_n20_fixture.pt"), vrplib_dir=str(tmp_path),
        bks=None, aug=8, batch_size=None, pomo_size=None, num_instances=None, seed=0, progress=False,
        data_dir=None, problems="ALL", size=50, reference=None)
    with pytest.raises(FileNotFoundError, match="no .vrp or Solomon .txt files"):
        cli.run_evaluation(pomo_mtl.get_config(), flags)


def test_costs_in_file_units_leave_out_the_return_of_open_routes(tmp_path):
    """evaluate.py's cost in a .vrp file's units: an open route does not drive back to the depot."""
    from mvmoe_jax import io

    text = ("NAME : square\nTYPE : {type}\nDIMENSION : 3\nEDGE_WEIGHT_TYPE : EUC_2D\nCAPACITY : 10\n"
            "NODE_COORD_SECTION\n1 0 0\n2 30 40\n3 30 0\nDEMAND_SECTION\n1 0\n2 1\n3 1\nDEPOT_SECTION\n1\n-1\nEOF\n")
    costs = {}
    for kind in ("CVRP", "OVRP"):
        path = tmp_path / f"{kind}.vrp"
        path.write_text(text.format(type=kind))
        inst, meta = io.read_vrplib(str(path))
        costs[kind] = cli._original_cost([1, 2], inst, meta)
    assert costs["CVRP"] == pytest.approx(50 + 40 + 30, rel=1e-6)       # 0 -> 1 -> 2 -> 0
    assert costs["OVRP"] == pytest.approx(50 + 40, rel=1e-6)            # no way back


def _classic_vrpb(path, second_pickup: int) -> str:
    """A VRPLIB VRPB file (classic rule): one delivery of 3, pickups of 20 and ``second_pickup``, capacity 30. The
    delivery opens the only route the pickups may use, so with a second pickup of 20 no solution exists."""
    path.write_text("NAME : {}\nTYPE : VRPB\nDIMENSION : 4\nEDGE_WEIGHT_TYPE : EUC_2D\nCAPACITY : 30\n"
                    "NODE_COORD_SECTION\n1 0 0\n2 0 10\n3 10 10\n4 5 5\n"
                    "LINEHAUL_SECTION\n1 0\n2 3\n3 0\n4 0\nBACKHAUL_SECTION\n1 0\n2 0\n3 20\n4 {}\n"
                    "DEPOT_SECTION\n1\n-1\nEOF\n".format(path.stem, second_pickup))
    return path.stem


def test_a_file_no_rollout_finishes_is_reported_unsolved_and_the_others_evaluated(tmp_path, capsys, monkeypatch):
    from mvmoe_jax import shipped, training
    from mvmoe_jax.nn.policy import PolicyConfig
    import jax

    cfg = PolicyConfig(model="mvmoe", embedding_dim=16, num_heads=2, num_layers=1, ff_hidden_dim=32,
                       expert_loc=("Enc0", "Dec"))
    shipped.export(tmp_path / "shipped" / "small_n20", training.init_params(cfg, jax.random.key(0)), cfg,
                   {"config": {"problem_size": 20}})
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "shipped")
    folder = tmp_path / "files"
    folder.mkdir()
    stuck, fine = _classic_vrpb(folder / "stuck.vrp", 20), _classic_vrpb(folder / "fine.vrp", 5)
    flags = types.SimpleNamespace(checkpoint="small_n20", vrplib_dir=str(folder), bks=None, aug=8,
                                  batch_size=None, pomo_size=None, num_instances=None, seed=0, progress=False,
                                  data_dir=None, problems="ALL", size=50, reference=None)
    res = cli.run_evaluation(None, flags)
    assert res[stuck]["solved"] is False and res[stuck]["obj"] is None and res[stuck]["gap"] is None
    assert "stuck" in capsys.readouterr().out.split("no solution found")[0].splitlines()[-1]
    assert res[fine]["solved"] is True and sorted(v for v in res[fine]["route"] if v) == [1, 2, 3]
