"""Pure-functional environment for all 16 variants, written for ONE partial solution.

The behaviour is that of ``docs/environment.md`` (the reference implementation's masks and
costs, float32, eps = 1e-5). Variant flags live in the instance as arrays, so one compiled function
serves every variant; ``jax.vmap`` lifts the functions over POMO starts and the batch (see the
``batch_*`` forms below, which share the instance across the POMO axis instead of copying it).

Public contract::

    s = reset(inst)          # vehicle at the depot (the state after the reference's forced first move)
    m = action_mask(s)       # bool[n+1], True = feasible next node, 0 = depot
    s = step(s, a)           # a: node index
    done(s)                  # all customers served and back at the depot
    cost(s)                  # tour length so far (open variants: moves into the depot cost 0)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from flax import struct

from mvmoe_jax.instances import Instance
from mvmoe_jax.problems import CLASSIC_RULE, MIXED_RULE, PAPER_RULE

EPS = 1e-5

# Feasibility rules, in the order of docs/environment.md; ``violations`` returns one row per rule.
RULES = ("visited", "capacity", "backhaul_overload", "backhaul_order", "route_limit", "time_window",
         "depot_closing", "finished")


@struct.dataclass
class State:
    """One partial solution (batched forms add leading axes to every field except ``instance`` and
    ``distances``, which belong to the instance).

      instance:  the Instance being solved.
      distances: float32 (n+1, n+1) distances between nodes, computed once at reset (see distance_matrix).
      current:   int32 ()      node the vehicle stands on.
      load:      float32 ()    paper rule: the load on board of a vehicle that left full (capacity 1); classic
                               and mixed rules: the room left for the route's next delivery.
      delivered: float32 ()    deliveries made on the current route (0 at the depot).
      picked:    float32 ()    pickups made on the current route (0 at the depot).
      peak:      float32 ()    the largest ``picked - delivered`` at any point of the current route so far, 0
                               at the depot (mixed rule: what the vehicle carries above the route's deliveries).
      time:      float32 ()    time after serving ``current`` (0 without TW, 0 at the depot).
      length:    float32 ()    length of the current route (0 at the depot).
      cost:      float32 ()    total tour length so far (open variants: moves into the depot cost 0).
      visited:   bool (n+1,)   customers served; the depot's entry is True only while standing on it.
      finished:  bool ()       every customer served and back at the depot.
      num_steps: int32 ()      moves made since reset (the forced depot move not counted).
    """

    instance: Instance
    distances: jax.Array
    current: jax.Array
    load: jax.Array
    delivered: jax.Array
    picked: jax.Array
    peak: jax.Array
    time: jax.Array
    length: jax.Array
    cost: jax.Array
    visited: jax.Array
    finished: jax.Array
    num_steps: jax.Array


def distance_matrix(locs: jax.Array) -> jax.Array:
    """(n+1, n+1) Euclidean distances, row i from node i, each computed as the reference does for one
    move (``sqrt(dx^2 + dy^2)``, every operation rounded to float32). A decoding step reads rows of it
    rather than recomputing the distances from the current node, a minor-axis reduction that XLA:CPU runs
    slowly (see docs/performance.md, "Distance matrix").

    Why not ``sqrt(sum(diff ** 2, axis=-1))`` or ``sqrt(dx * dx + dy * dy)``: XLA:CPU contracts a square
    and the sum into a fused multiply-add wherever its own loop emitter compiles them (every size for the
    second form, n = 20 for the first), which rounds once where the reference rounds twice (distances 1 ulp
    off). The squares pass through an integer XOR with a zero that XLA and LLVM cannot see is zero
    (``isnan`` of the first coordinate; validated instances have none), which keeps each one rounded:
    bitwise the reference's at every size, and no slower than the first form."""
    x, y = locs[..., 0], locs[..., 1]
    dx = x[..., None, :] - x[..., :, None]
    dy = y[..., None, :] - y[..., :, None]
    opaque_zero = jnp.isnan(locs[..., :1, :1]).astype(jnp.int32)
    def rounded(v):
        return lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.int32) ^ opaque_zero, jnp.float32)
    return jnp.sqrt(rounded(dx * dx) + rounded(dy * dy))


def _initial(inst: Instance) -> State:
    n1 = inst.locs.shape[-2]
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    return State(instance=inst, distances=distance_matrix(inst.locs), current=jnp.int32(0), load=f32(1.0),
                 delivered=f32(0.0), picked=f32(0.0), peak=f32(0.0), time=f32(0.0), length=f32(0.0), cost=f32(0.0), visited=jnp.zeros((n1,), bool),
                 finished=jnp.asarray(False), num_steps=jnp.int32(-1))


def reset(inst: Instance) -> State:
    """The state after the forced first move to the depot (vehicle at the depot, full)."""
    return step(_initial(inst), jnp.int32(0))


def step(state: State, action: jax.Array) -> State:
    """Move the vehicle to node ``action`` (no feasibility check: see ``action_mask``)."""
    inst = state.instance
    a = jnp.asarray(action, jnp.int32)
    d = state.distances[state.current, a]
    at_depot = a == 0

    paper_load = jnp.where(at_depot, 1.0, state.load - inst.demand[a])
    delivered = jnp.where(at_depot, 0.0, state.delivered + jnp.maximum(inst.demand[a], 0.0))
    picked = jnp.where(at_depot, 0.0, state.picked + jnp.maximum(-inst.demand[a], 0.0))
    peak = jnp.where(at_depot, 0.0, jnp.maximum(state.peak, picked - delivered))
    length = jnp.where(at_depot, 0.0, state.length + d)
    arrival = jnp.maximum(state.time + d, inst.tw_start[a]) + inst.service_time[a]
    time = jnp.where(at_depot | ~inst.has_tw, 0.0, arrival)

    visited = state.visited.at[a].set(True).at[0].set(at_depot)
    # Paper rule: back at the depot with only backhauls left, the vehicle leaves empty and picks up.
    linehaul_left = jnp.any(~visited & (inst.demand > 0))
    paper_load = jnp.where(at_depot & ~linehaul_left, 0.0, paper_load)
    rule = inst.backhaul_rule
    load = jnp.where(rule == PAPER_RULE, paper_load,
                     1.0 - delivered - jnp.where(rule == MIXED_RULE, peak, 0.0))

    step_cost = jnp.where(inst.is_open & at_depot, 0.0, d)
    return state.replace(
        current=a, load=load.astype(jnp.float32), delivered=delivered.astype(jnp.float32),
        picked=picked.astype(jnp.float32), peak=peak.astype(jnp.float32), time=time.astype(jnp.float32),
        length=length.astype(jnp.float32), cost=state.cost + step_cost, visited=visited,
        finished=state.finished | jnp.all(visited), num_steps=state.num_steps + 1)


def violations(state: State) -> jax.Array:
    """bool (len(RULES), n+1): which feasibility rule forbids each next node (any True = infeasible)."""
    inst = state.instance
    demand = inst.demand
    d_cur = state.distances[state.current]
    d_depot = state.distances[0]
    is_depot = jnp.arange(demand.shape[-1]) == 0
    close = inst.tw_end[0]

    visited = state.visited
    rule = inst.backhaul_rule
    is_back = demand < 0
    capacity = state.load + EPS < demand
    # Pickups: paper, the load on board (vehicle left full) stays within capacity; classic and mixed, the
    # route's pickups fit the capacity.
    on_board = jnp.where(rule == PAPER_RULE, state.load, state.picked)
    overload = inst.has_backhaul & (on_board - demand > 1.0 + EPS)
    # Classic: a route starts with a linehaul, and no linehaul follows a backhaul.
    after_pickup = state.picked > 0
    order = ((rule == CLASSIC_RULE) & inst.has_backhaul & ~is_depot
             & jnp.where(is_back, state.current == 0, after_pickup))
    closed_limit = state.length + d_cur + d_depot > inst.route_limit + EPS
    open_limit = (state.length + d_cur > inst.route_limit + EPS) & ~is_depot
    route_limit = inst.has_limit & jnp.where(inst.is_open, open_limit, closed_limit)
    start = jnp.maximum(state.time + d_cur, inst.tw_start)
    late = (start > inst.tw_end + EPS) & ~(is_depot & inst.is_open)
    time_window = inst.has_tw & late
    depot_closing = inst.has_tw & ~inst.is_open & (start + inst.service_time + d_depot > close + EPS)

    rules = jnp.stack([visited, capacity, overload, order, route_limit, time_window, depot_closing,
                       jnp.zeros_like(visited)])
    # A finished trajectory may only stay at the depot.
    finished_rules = jnp.zeros_like(rules).at[-1].set(~is_depot)
    return jnp.where(state.finished, finished_rules, rules)


def stranded_backhauls(state: State) -> jax.Array:
    """bool (n+1,): classic rule, moves after which the unserved pickups cannot fit the routes left to serve them.

    Under the classic rule every route starts with a linehaul, so after a move to j the pickups still unserved
    must fit into what the current route can still pick up (``1 - picked``, none once back at the depot) plus
    one capacity per unserved linehaul (each can start a route). A move that breaks this leaves no feasible
    completion (it is a necessary condition, so a feasible solution never makes such a move); the mask blocks
    it so that a decoder does not walk into a dead end, e.g. back to the depot with only backhauls left. Not a
    rule of the problem: the checker does not report it. False everywhere under the other rules."""
    inst = state.instance
    demand = inst.demand
    is_depot = jnp.arange(demand.shape[-1]) == 0
    open_nodes = ~state.visited & ~is_depot
    pickups_left = jnp.sum(jnp.where(open_nodes, jnp.maximum(-demand, 0.0), 0.0))
    starts_left = jnp.sum(open_nodes & (demand >= 0))
    # After moving to j: j's pickup is served, j no longer an unserved linehaul, the route's room shrinks.
    pickup_j = jnp.where(open_nodes, jnp.maximum(-demand, 0.0), 0.0)
    starts_after = starts_left - (open_nodes & (demand >= 0))
    room_after = jnp.where(is_depot, 0.0, 1.0 - state.picked - jnp.maximum(-demand, 0.0))
    stranded = pickups_left - pickup_j > room_after + starts_after + EPS
    return (inst.backhaul_rule == CLASSIC_RULE) & inst.has_backhaul & stranded & ~state.finished


def action_mask(state: State) -> jax.Array:
    """bool (n+1,): True where the next node is feasible (no rule of ``violations`` fires) and, under the classic
    backhaul rule, does not strand the remaining pickups (``stranded_backhauls``). Should no move be left (a
    classic dead end that the lookahead cannot foresee, e.g. with time windows), the depot is allowed: the
    trajectory then stays there unfinished, and the rollout scores it +inf."""
    allowed = ~jnp.any(violations(state), axis=0) & ~stranded_backhauls(state)
    return allowed.at[0].set(allowed[0] | ~jnp.any(allowed))


def done(state: State) -> jax.Array:
    return state.finished


def cost(state: State) -> jax.Array:
    return state.cost


# ----------------------------------------------------------------------------------------------------
# Batched forms: states of shape (batch, pomo); the instance has only the batch axis.
# ----------------------------------------------------------------------------------------------------

_PER_INSTANCE = ("instance", "distances")


def _state_axes(instance_axis) -> State:
    """vmap axes for a State: 0 for every per-trajectory field, ``instance_axis`` for the instance and
    its distances."""
    fields = {f: 0 for f in State.__dataclass_fields__ if f not in _PER_INSTANCE}
    return State(instance=instance_axis, distances=instance_axis, **fields)


# Inner vmap over POMO starts shares the instance (axis None); the outer one maps the batch.
batch_step = jax.vmap(jax.vmap(step, in_axes=(_state_axes(None), 0), out_axes=_state_axes(None)))
batch_step.__doc__ = "step for states (batch, pomo) and actions int (batch, pomo)."
batch_action_mask = jax.vmap(jax.vmap(action_mask, in_axes=(_state_axes(None),)))
batch_action_mask.__doc__ = "action_mask for states (batch, pomo) -> bool (batch, pomo, n+1)."


def batch_reset(instances: Instance, pomo_size: int) -> State:
    """Reset a batch of instances (leading batch axis) into states of shape (batch, pomo)."""
    single = jax.vmap(reset)(instances)

    def expand(x):
        return jnp.broadcast_to(x[:, None], (x.shape[0], pomo_size) + x.shape[1:])

    fields = {f: expand(getattr(single, f)) for f in State.__dataclass_fields__ if f not in _PER_INSTANCE}
    return State(instance=instances, distances=single.distances, **fields)
