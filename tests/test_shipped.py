"""Shipped models: loading by name everywhere a checkpoint is taken, their cards' checks, damaged files."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import script_module
from mvmoe_jax import checker, checkpoints, shipped, training
from mvmoe_jax.instances import generate
from mvmoe_jax.nn.policy import PolicyConfig
from mvmoe_jax.rollout import greedy_evaluate

SMALL = PolicyConfig(model="mvmoe", embedding_dim=32, num_heads=4, num_layers=2, ff_hidden_dim=64,
                     expert_loc=("Enc0", "Enc1", "Dec"))
CHECK = dict(seed=3, num_instances=2, num_customers=20, variants="CVRP,VRPBLTW")


@pytest.fixture(scope="module")
def small_model():
    return SMALL, training.init_params(SMALL, jax.random.key(7))


@pytest.fixture
def shipped_root(tmp_path, monkeypatch, small_model):
    """A shipped-models folder holding one small freshly initialised model, ``tiny``."""
    cfg, params = small_model
    check = shipped.check_objectives(cfg, params, **CHECK)
    shipped.export(tmp_path / "tiny", params, cfg, {"command": "none", "check": {**CHECK, "objectives": check}})
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path)
    return tmp_path


def _flat(tree):
    return {"/".join(map(str, k)): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_a_shipped_name_loads_the_exported_parameters_exactly(shipped_root, small_model):
    cfg, params = small_model
    assert shipped.names() == ["tiny"]
    got_cfg, got = checkpoints.load_policy("tiny")
    assert got_cfg == cfg
    want, have = _flat(params), _flat(got)
    assert want.keys() == have.keys()
    for k in want:
        np.testing.assert_array_equal(have[k], want[k], err_msg=k)
        assert have[k].dtype == np.float32


def test_the_cards_check_reproduces_and_its_routes_pass_the_checker(shipped_root):
    cfg, params = checkpoints.load_policy("tiny")
    card = shipped.card("tiny")
    check = {k: card["check"][k] for k in CHECK}
    again = shipped.check_objectives(cfg, params, **check)
    for var, objs in card["check"]["objectives"].items():
        np.testing.assert_allclose(again[var], objs, rtol=1e-6, err_msg=var)
    # Every route behind those objectives is feasible and costs what it says, by the independent checker.
    for i, var in enumerate(check["variants"].split(",")):
        batch = generate(jax.random.fold_in(jax.random.key(check["seed"]), i), check["num_instances"],
                         check["num_customers"], var)
        res = greedy_evaluate(cfg, params, batch, jax.random.key(0), pomo_size=check["num_customers"],
                              augment=False)
        for b in range(check["num_instances"]):
            inst = jax.tree.map(lambda x: x[b], batch)
            report = checker.check_route(inst, np.asarray(res.best_actions[b]))
            assert report.feasible, (var, b, report)
            np.testing.assert_allclose(report.cost, float(res.obj_no_aug[b]), rtol=1e-5)


def test_a_config_of_another_architecture_is_refused(shipped_root):
    with pytest.raises(checkpoints.CheckpointMismatchError, match="another architecture.*embedding_dim"):
        checkpoints.load_policy("tiny", PolicyConfig(model="mvmoe"))


def test_an_unknown_name_lists_the_shipped_models(shipped_root):
    with pytest.raises(FileNotFoundError, match=r"'mvmoe_9e_n50' is not the name of a shipped model.*tiny"):
        checkpoints.load_policy("mvmoe_9e_n50")


def test_damaged_or_missing_weights_get_a_clear_error(shipped_root):
    path = shipped_root / "tiny" / shipped.PARAMS_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(shipped.ShippedModelError, match="'tiny'.*damaged"):
        checkpoints.load_policy("tiny")
    path.write_bytes(b"")
    with pytest.raises(shipped.ShippedModelError, match="damaged"):
        checkpoints.load_policy("tiny")
    # Without a recorded checksum a truncated archive is still refused by name, not by a zipfile traceback.
    card_path = shipped_root / "tiny" / shipped.CARD_FILE
    card = json.loads(card_path.read_text())
    card.pop("params_sha256")
    card_path.write_text(json.dumps(card))
    with pytest.raises(shipped.ShippedModelError, match="'tiny'.*cannot be read"):
        checkpoints.load_policy("tiny")
    path.unlink()
    with pytest.raises(shipped.ShippedModelError, match="'tiny' is missing its weights file"):
        checkpoints.load_policy("tiny")


def test_a_damaged_card_gets_a_clear_error(shipped_root):
    (shipped_root / "tiny" / shipped.CARD_FILE).write_text("{not json")
    with pytest.raises(shipped.ShippedModelError, match="card of shipped model 'tiny'"):
        checkpoints.load_policy("tiny")


@pytest.mark.parametrize("name", shipped.names())
def test_every_shipped_model_loads_and_reproduces_its_card(name):
    cfg, params = checkpoints.load_policy(name)
    card = shipped.card(name)
    check = card["check"]
    again = shipped.check_objectives(cfg, params, **{k: check[k] for k in CHECK})
    for var, objs in check["objectives"].items():
        np.testing.assert_allclose(again[var], objs, rtol=1e-5, err_msg=f"{name} {var}")


def test_the_cards_results_merge_reports_by_section_without_per_instance_outputs(tmp_path):
    """scripts/ship_model.py: the card's table merges paper_tables reports (n50 from one, setx from another),
    each section with the checkpoint, machine and commit that measured it and without per-instance outputs; in a
    report of several models it takes the one with the shipped name; a section measured on the shipped run's own
    workdir names the shipped model instead of the path; a section measured twice, reports for
    different paper columns, or a report of several models none of them the shipped one, are refused."""
    ship_model = script_module("scripts/ship_model.py")

    def report(name, commit, entry, **others):
        path = tmp_path / name
        path.write_text(json.dumps({"machine": "m", "commit": commit, "date": "d", "num_instances": None,
                                    "models": {"mvmoe_4e_n50": entry, **others}}))
        return str(path)

    n50 = report("a.json", "c1", {"checkpoint": "runs/b", "paper_model": "MVMoE/4E",
                                  "n50": {"rows": [{"variant": "CVRP", "gap": 2.4}], "results": {"CVRP": [1.0]}}})
    setx = report("b.json", "c2", {"checkpoint": "mvmoe_4e_n50", "paper_model": "MVMoE/4E",
                                   "setx": {"rows": [{"group": "100 <= n < 200", "gap": 10.9}]}})
    table = ship_model.results_table([n50, setx], "mvmoe_4e_n50", "runs/a")
    assert table["paper_model"] == "MVMoE/4E" and "checkpoint" not in table
    assert table["n50"] == {"rows": [{"variant": "CVRP", "gap": 2.4}], "checkpoint": "runs/b", "machine": "m",
                            "commit": "c1", "date": "d", "num_instances": None}
    assert table["setx"]["commit"] == "c2" and table["setx"]["checkpoint"] == "mvmoe_4e_n50"
    shipped_from_b = ship_model.results_table([n50, setx], "mvmoe_4e_n50", os.path.abspath("runs/b"))
    assert shipped_from_b["n50"]["checkpoint"] == "mvmoe_4e_n50"
    with pytest.raises(ValueError, match="section 'n50' is in two of the reports"):
        ship_model.results_table([n50, n50], "mvmoe_4e_n50", "runs/a")
    other = report("c.json", "c3", {"checkpoint": "runs/b", "paper_model": "POMO-MTL", "n100": {"rows": []}})
    with pytest.raises(ValueError, match="paper_model is 'POMO-MTL', another report has 'MVMoE/4E'"):
        ship_model.results_table([n50, other], "mvmoe_4e_n50", "runs/a")
    # A comparison of two models measured in one run: each model's card takes its own column.
    pomo = {"checkpoint": "runs/p", "paper_model": "POMO-MTL", "n50": {"rows": [{"variant": "CVRP", "gap": 2.9}]}}
    both = report("d.json", "c4", {"checkpoint": "mvmoe_4e_n50", "paper_model": "MVMoE/4E",
                                   "n50": {"rows": [{"variant": "CVRP", "gap": 2.4}]}}, pomo_mtl_n50=pomo)
    pomo_table = ship_model.results_table([both], "pomo_mtl_n50", "runs/a")
    assert pomo_table["n50"]["rows"] == [{"variant": "CVRP", "gap": 2.9}]
    assert ship_model.results_table([both], "mvmoe_4e_n50", "runs/a")["paper_model"] == "MVMoE/4E"
    with pytest.raises(ValueError, match="no model labelled 'pomo_mtl_n100' among"):
        ship_model.results_table([both], "pomo_mtl_n100", "runs/a")
