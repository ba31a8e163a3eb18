"""The three backhaul rules (docs/environment.md, "Backhaul rules"): the environment's mask against a plainly
written check of each rule on random partial routes, the checker on the routes each rule must reject, the best-known
solutions of VRPLIB's VRP with backhauls, and which rule each reader gives."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mvmoe_jax import checker, env, instances, problems
from mvmoe_jax.instances import from_arrays, with_backhaul_rule
from mvmoe_jax.io import load_npz, read_json_instances, read_vrplib, save_npz
from mvmoe_jax.solve import inputs

from conftest import require_shared

EPS = env.EPS
N = 20
B_VARIANTS = [v for v in problems.VARIANTS if v.backhaul]


# ----------------------------------------------------------------------------------------------------
# The rules written out plainly, on numpy arrays, for one partial solution
# ----------------------------------------------------------------------------------------------------

class Plain:
    """One instance as float64 numpy and a partial solution as the list of nodes visited after the start at the
    depot; ``allowed(j)`` says whether the next move may go to j, each rule written as docs/environment.md states it."""

    def __init__(self, inst, moves):
        f = lambda k: np.asarray(getattr(inst, k), np.float64)
        self.xy, self.q, self.tws, self.twe, self.svc = f("locs"), f("demand"), f("tw_start"), f("tw_end"), f("service_time")
        self.limit = float(inst.route_limit)
        self.is_open, self.has_b, self.has_l, self.has_tw = (bool(getattr(inst, k)) for k in (
            "is_open", "has_backhaul", "has_limit", "has_tw"))
        self.rule = problems.BACKHAUL_RULES[int(inst.backhaul_rule)]
        self.n = len(self.q) - 1
        self.moves = list(moves)
        self.served = {v for v in self.moves if v != 0}
        last_depot = max([i for i, v in enumerate(self.moves) if v == 0], default=-1)
        self.route = self.moves[last_depot + 1:]          # customers of the current route, in order
        self.cur = self.moves[-1] if self.moves else 0

    def d(self, a, b):
        return math.dist(self.xy[a], self.xy[b])

    def finished(self):
        return self.cur == 0 and len(self.served) == self.n

    def _clock_and_length(self):
        t, length, here = 0.0, 0.0, 0
        for c in self.route:
            length += self.d(here, c)
            t = max(t + self.d(here, c), self.tws[c]) + self.svc[c] if self.has_tw else 0.0
            here = c
        return t, length

    def _paper_load(self):
        """The paper's load: full at the depot (empty once no linehaul is left), minus each demand."""
        served_before = {v for v in self.moves[:len(self.moves) - len(self.route)] if v != 0}
        linehaul_left = any(self.q[c] > 0 and c not in served_before for c in range(1, self.n + 1))
        load = 1.0 if linehaul_left else 0.0
        for c in self.route:
            load -= self.q[c]
        return load

    def _load_fits(self, j):
        """Capacity and pickups, by rule, for a move to customer j."""
        q, route = self.q, self.route
        if self.rule == "paper" or not self.has_b:
            load = self._paper_load() if self.has_b else 1.0 - sum(q[c] for c in route)
            return load + EPS >= q[j] and (not self.has_b or load - q[j] <= 1 + EPS)
        new = route + [j]
        deliveries = sum(max(q[c], 0) for c in new)
        pickups = sum(max(-q[c], 0) for c in new)
        if self.rule == "classic":
            if q[j] >= 0:      # a linehaul: before any backhaul of the route, and the deliveries fit
                return not any(q[c] < 0 for c in route) and deliveries <= 1 + EPS
            return len(route) > 0 and pickups <= 1 + EPS      # a backhaul: not first, and the pickups fit
        # mixed: the vehicle leaves with the route's deliveries; the load on board never exceeds the capacity
        on_board = deliveries
        if on_board > 1 + EPS:
            return False
        for c in new:
            on_board += -q[c]
            if on_board > 1 + EPS:
                return False
        return True

    def _strands_backhauls(self, j):
        """Classic: after the move, the pickups left exceed what the current route can still take plus one full
        vehicle for each linehaul left (each can start a route)."""
        if self.rule != "classic" or not self.has_b:
            return False
        served = self.served | {j}
        left = [c for c in range(1, self.n + 1) if c not in served]
        pickups_left = sum(-self.q[c] for c in left if self.q[c] < 0)
        starts_left = sum(1 for c in left if self.q[c] >= 0)
        room = 0.0 if j == 0 else 1.0 - sum(-self.q[c] for c in self.route + [j] if self.q[c] < 0)
        return pickups_left > room + starts_left + EPS

    def _rules_allow(self, j):
        if self.finished():
            return j == 0
        if j == 0 and self.cur == 0:
            return False
        if j != 0 and (j in self.served or not self._load_fits(j)):
            return False
        t, length = self._clock_and_length()
        step = self.d(self.cur, j)
        if self.has_l:
            if self.is_open and j != 0 and length + step > self.limit + EPS:
                return False
            if not self.is_open and length + step + self.d(j, 0) > self.limit + EPS:
                return False
        if self.has_tw:
            start = max(t + step, self.tws[j])
            if start > self.twe[j] + EPS and not (j == 0 and self.is_open):
                return False
            if not self.is_open and start + self.svc[j] + self.d(j, 0) > self.twe[0] + EPS:
                return False
        return True

    def allowed(self, j):
        return self._rules_allow(j) and not self._strands_backhauls(j)

    def mask(self):
        out = np.array([self.allowed(j) for j in range(self.n + 1)])
        if not out.any():
            out[0] = True          # a dead end: only the depot, where the trajectory stays unfinished
        return out


# ----------------------------------------------------------------------------------------------------
# The mask against the plain rules
# ----------------------------------------------------------------------------------------------------

_reset = jax.jit(env.reset)
_step = jax.jit(env.step)
_mask = jax.jit(env.action_mask)


POOL = 16


def generated(variants=B_VARIANTS, backhaul_rule="paper", seed=72):
    """16 generated instances of n = 20 (always 16: one compilation for every test of the file)."""
    return jax.device_get(instances.generate(jax.random.key(seed), POOL, N, variants, backhaul_rule=backhaul_rule))


@pytest.fixture(scope="module")
def pool():
    """16 generated instances of n = 20, each of one of the 8 variants with backhauls, drawn once."""
    return generated()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.integers(0, POOL - 1), rule=st.sampled_from(problems.BACKHAUL_RULES), heavier=st.sampled_from([1.0, 2.5, 4.0]),
       backhaul_share=st.sampled_from([None, 0.5]), seed=st.integers(0, 2**31 - 1))
def test_the_mask_is_each_rule_written_plainly(pool, index, rule, heavier, backhaul_share, seed):
    """On a random instance (demands scaled up so that the capacity binds, or half the customers backhauls), a
    random walk through the mask: at every step the mask equals the plain rules of ``Plain``."""
    rng = np.random.default_rng(seed)
    inst = jax.tree.map(lambda x: x[index], pool)
    q = np.asarray(inst.demand, np.float64)
    if backhaul_share is not None:
        flip = rng.random(N) < backhaul_share
        q[1:] = np.where(flip, -np.abs(q[1:]), np.abs(q[1:]))
    q = np.clip(q * heavier, -1.0, 1.0)
    inst = with_backhaul_rule(inst.replace(demand=jnp.asarray(q, jnp.float32)), rule)
    state, moves = _reset(inst), []
    for _ in range(2 * N + 2):
        got = np.asarray(_mask(state))
        want = Plain(inst, moves).mask()
        assert (got == want).all(), (rule, moves, np.flatnonzero(got != want))
        a = int(rng.choice(np.flatnonzero(got)))
        state, moves = _step(state, a), moves + [a]
        if bool(state.finished):
            break


def test_paper_rule_is_the_default_everywhere(pool):
    assert instances.backhaul_rule_names(pool) == ["paper"] * POOL
    mixed = generated(backhaul_rule=["classic", "mixed"])
    assert instances.backhaul_rule_names(mixed) == ["classic", "mixed"] * (POOL // 2)
    np.testing.assert_array_equal(np.asarray(mixed.locs), np.asarray(pool.locs))      # the draw is the same
    with pytest.raises(ValueError, match="unknown backhaul rule 'pickup'"):
        generated(backhaul_rule="pickup")


# ----------------------------------------------------------------------------------------------------
# The checker on the routes the rules tell apart
# ----------------------------------------------------------------------------------------------------

# A depot and four customers on a line; capacity 10. Nodes 1 and 2 deliver 6 each, node 3 picks up 5, node 4
# delivers 3.
LINE = np.array([[0, 0], [1, 0], [2, 0], [3, 0], [4, 0]], np.float64)
LINE_DEMAND = np.array([6, 6, -5, 3], np.float64)


def _line(rule, variant="VRPB"):
    inst = from_arrays(LINE[None, :1] / 10, LINE[None, 1:] / 10, LINE_DEMAND[None], 10.0, variant=variant,
                       backhaul_rule=rule)
    return jax.tree.map(lambda x: x[0], inst)


@pytest.mark.parametrize("route, verdicts", [
    # Deliveries of 12 on a capacity of 10, with a pickup between them: the paper's rule lets the pickup free room.
    ([1, 3, 2, 0, 4], {"paper": None, "classic": "capacity", "mixed": "capacity"}),
    # A delivery after a pickup, within every capacity: only the classic rule forbids it.
    ([1, 3, 4, 0, 2], {"paper": None, "classic": "backhaul_order", "mixed": None}),
    # A route that starts with a pickup: the paper's rule has the vehicle leave full (no room), classic forbids it.
    ([3, 0, 1, 0, 2, 4], {"paper": "backhaul_overload", "classic": "backhaul_order", "mixed": None}),
    # Mixed: the vehicle leaves with node 1's 6 and picks up 5 first: 11 on board.
    ([3, 1, 4, 0, 2], {"paper": "backhaul_overload", "classic": "backhaul_order", "mixed": "capacity"}),
    # Linehauls, then the backhaul: feasible under every rule.
    ([1, 4, 3, 0, 2], {"paper": None, "classic": None, "mixed": None}),
])
def test_the_checker_rejects_what_each_rule_forbids(route, verdicts):
    for rule, violation in verdicts.items():
        got = checker.check_route(_line(rule), route)
        assert got.violation == violation, (rule, route, got)


def test_the_classic_rule_strands_no_backhaul_but_the_checker_names_the_rules_only():
    """Back at the depot with only the backhaul left: no route could start for it. The mask blocks that return; the
    checker, which reports broken rules, finds the route unfinishable where it next moves (a route starting with a
    backhaul)."""
    inst = _line("classic")
    state = env.reset(inst)
    for a in (1, 0, 2, 4):
        state = env.step(state, a)
    assert not bool(env.action_mask(state)[0]) and bool(env.stranded_backhauls(state)[0])
    assert checker.check_route(inst, [1, 0, 2, 4, 0, 3]).violation == "backhaul_order"


def test_classic_instances_without_a_linehaul_are_refused():
    inst = from_arrays(LINE[None, :1] / 10, LINE[None, 1:3] / 10, np.array([[-3.0, -4.0]]), 10.0, variant="VRPB",
                       backhaul_rule="classic")
    with pytest.raises(checker.InfeasibleInstanceError):
        checker.validate_instances(inst)
    reasons = checker.unservable_reasons(jax.tree.map(lambda x: x[0], inst))
    assert len(reasons) == 2 and "route starts with a linehaul" in reasons[0]
    checker.validate_instances(with_backhaul_rule(inst, "mixed"))


# ----------------------------------------------------------------------------------------------------
# VRPLIB's VRP with backhauls: the best-known solutions of Queiroga et al. (2020) under the classic rule
# ----------------------------------------------------------------------------------------------------

QUEIROGA = ("X-n524-50-k125", pytest.param("X-n536-50-k49", marks=pytest.mark.slow))


@pytest.fixture(scope="module")
def queiroga_dir():
    return require_shared("data", "external", "vrpb-queiroga")


@pytest.mark.parametrize("name", QUEIROGA)
def test_queiroga_best_known_routes_pass_the_classic_checker(queiroga_dir, name):
    """The file's best-known routes are feasible under the classic rule, with the file's cost (every edge rounded to
    an integer, EUC_2D); the paper's rule reads the same routes, which is why it must not be the one applied."""
    import vrplib

    inst, meta = read_vrplib(queiroga_dir / f"{name}.vrp")
    assert meta.variant == "VRPB" and meta.backhaul_rule == "classic"
    sol = vrplib.read_solution(str(queiroga_dir / f"{name}.sol"))
    flat = [c for r in sol["routes"] for c in [*r, 0]]
    got = checker.check_route(jax.tree.map(lambda x: x[0], inst), flat)
    assert got.feasible, got
    assert checker.tours_cost(meta.coords, sol["routes"], False, rounded=True) == sol["cost"]
    assert got.cost * meta.scale == pytest.approx(checker.tours_cost(meta.coords, sol["routes"], False), rel=1e-5)
    # PyVRP's reading of the file agrees: feasible, at the file's cost; a route turned round breaks the order.
    from mvmoe_jax.baselines import pyvrp_solver

    verdict = pyvrp_solver.check_vrplib_routes(queiroga_dir / f"{name}.vrp", sol["routes"])
    assert verdict.feasible and verdict.distance == sol["cost"]
    turned = [list(r) for r in sol["routes"]]
    k = next(i for i, r in enumerate(turned) if inst.demand[0, r[-1]] < 0)
    turned[k] = turned[k][::-1]
    assert not pyvrp_solver.check_vrplib_routes(queiroga_dir / f"{name}.vrp", turned).feasible
    flat = [c for r in turned for c in [*r, 0]]
    assert not checker.check_route(jax.tree.map(lambda x: x[0], inst), flat).feasible


# ----------------------------------------------------------------------------------------------------
# Which rule each reader gives
# ----------------------------------------------------------------------------------------------------

def _vrp(path, *, type_=None, pickups=True):
    coords = "".join(f"{i + 1} {x:g} {y:g}\n" for i, (x, y) in enumerate(LINE * 10))
    delivery = [0, 6, 6, 0, 3]
    pickup = [0, 0, 0, 5, 0] if pickups else [0] * 5
    rows = lambda v: "".join(f"{i + 1} {x}\n" for i, x in enumerate(v))
    text = f"NAME : t\n{'TYPE : ' + type_ + chr(10) if type_ else ''}DIMENSION : 5\nEDGE_WEIGHT_TYPE : EUC_2D\n"
    text += f"CAPACITY : 10\nNODE_COORD_SECTION\n{coords}"
    text += ("LINEHAUL_SECTION\n" + rows(delivery) + "BACKHAUL_SECTION\n" + rows(pickup)) if pickups else (
        "DEMAND_SECTION\n" + rows(delivery))
    path.write_text(text + "DEPOT_SECTION\n1\n-1\nEOF\n")
    return path


@pytest.mark.parametrize("type_, pickups, stated, want", [
    ("VRPB", True, None, "classic"),          # VRPLIB's VRPB
    (None, True, None, "classic"),            # PyVRP's dialect without a TYPE
    ("CVRP", False, None, "paper"),           # no backhauls: the rule is moot, and the paper's
    ("VRPB", True, "mixed", "mixed"),         # stated by the caller (--backhauls)
])
def test_vrplib_files_read_under_their_rule(tmp_path, type_, pickups, stated, want):
    inst, meta = read_vrplib(_vrp(tmp_path / "a.vrp", type_=type_, pickups=pickups), backhaul_rule=stated)
    assert meta.backhaul_rule == want and instances.backhaul_rule_names(inst) == [want]


def _json(path, **extra):
    obj = {"capacity": 10, "depot": [0, 0], "customers": (LINE[1:] * 10).tolist(), "demand": LINE_DEMAND.tolist()}
    obj.update(extra)
    path.write_text(json.dumps(obj))
    return path


def test_json_files_say_their_rule(tmp_path):
    for rule in problems.BACKHAUL_RULES:
        [(inst, meta)] = read_json_instances(_json(tmp_path / f"{rule}.json", backhauls=rule))
        assert meta.backhaul_rule == rule and instances.backhaul_rule_names(inst) == [rule]
    with pytest.raises(ValueError, match="say which backhaul rule holds with 'backhauls'"):
        read_json_instances(_json(tmp_path / "unsaid.json"))
    with pytest.raises(ValueError, match="'backhauls' must be one of"):
        read_json_instances(_json(tmp_path / "bad.json", backhauls="simultaneous"))
    [(_, meta)] = read_json_instances(_json(tmp_path / "plain.json", demand=[6, 6, 5, 3]))
    assert meta.backhaul_rule == "paper"
    [(_, meta)] = read_json_instances(_json(tmp_path / "unsaid.json"), backhaul_rule="mixed")
    assert meta.backhaul_rule == "mixed"


def test_npz_keeps_the_rule_and_reads_older_files_as_paper(tmp_path):
    batch = generated(["OVRPB"], backhaul_rule=["mixed", "classic", "paper"])
    save_npz(tmp_path / "b.npz", batch)
    assert instances.backhaul_rule_names(load_npz(tmp_path / "b.npz")) == instances.backhaul_rule_names(batch)
    assert instances.backhaul_rule_names(batch)[:3] == ["mixed", "classic", "paper"]
    arrays = {k: np.asarray(getattr(batch, k)) for k in ("locs", "demand", "service_time", "tw_start", "tw_end",
                                                        "route_limit", "is_open", "has_backhaul", "has_limit", "has_tw")}
    np.savez(tmp_path / "v1.npz", __format_version__=np.asarray(1, np.int64), **arrays)
    assert instances.backhaul_rule_names(load_npz(tmp_path / "v1.npz")) == ["paper"] * POOL


def test_the_solver_inputs_take_the_files_rule_or_the_stated_one(tmp_path):
    _vrp(tmp_path / "a.vrp", type_="VRPB")
    _json(tmp_path / "b.json", backhauls="mixed")
    save_npz(tmp_path / "c.npz", instances.take(generated(["VRPB"]), np.arange(1)))
    read, refused = inputs.read_inputs([tmp_path])
    assert refused == []
    assert {p.name: p.backhaul_rule for p in read} == {"t": "classic", "b": "mixed", "c-0": "paper"}
    read, refused = inputs.read_inputs([tmp_path], backhauls="classic")
    assert refused == [] and {p.backhaul_rule for p in read} == {"classic"}


# ----------------------------------------------------------------------------------------------------
# Training under the rules
# ----------------------------------------------------------------------------------------------------

def test_training_batches_draw_the_configured_rules_over_the_same_instances():
    """The rules are drawn per instance from a stream of their own: the instances are those of a paper-rule batch."""
    from mvmoe_jax import training

    flags = tuple(tuple(bool(f) for f in problems.get_variant(v).flags) for v in ("VRPB", "OVRPBTW", "CVRP"))
    key = jax.random.key(3)
    batch = jax.jit(training.generate_training_batch, static_argnums=(1, 2, 3, 4, 5))
    paper = batch(key, 64, 20, flags, True, (problems.PAPER_RULE,))
    rules = (problems.CLASSIC_RULE, problems.MIXED_RULE)
    both = batch(key, 64, 20, flags, True, rules)
    for name in paper.__dataclass_fields__:
        if name != "backhaul_rule":
            np.testing.assert_array_equal(np.asarray(getattr(paper, name)), np.asarray(getattr(both, name)), name)
    assert set(instances.backhaul_rule_names(paper)) == {"paper"}
    drawn = instances.backhaul_rule_names(both)
    assert set(drawn) == {"classic", "mixed"} and 16 <= drawn.count("mixed") <= 48
    rows = jax.jit(training.generate_training_rows, static_argnums=range(1, 8))(key, 64, 16, 40, 20, flags, True, rules)
    assert instances.backhaul_rule_names(rows) == drawn[16:40]


def test_the_run_names_its_training_rules_and_refuses_unknown_ones():
    from mvmoe_jax import training_loop
    from test_training import tiny_config

    assert training_loop.check_config(tiny_config("unused")).backhaul_rules == ("paper",)
    run = training_loop.check_config(tiny_config("unused", train_backhaul_rules="mixed, classic,mixed"))
    assert run.backhaul_rules == ("mixed", "classic")
    assert "train_backhaul_rules" in training_loop.RUN_FIELDS
    for bad in ("simultaneous", "", "paper,tsp"):
        with pytest.raises(ValueError, match="train_backhaul_rules must name one or more of paper, classic, mixed"):
            training_loop.check_config(tiny_config("unused", train_backhaul_rules=bad))
