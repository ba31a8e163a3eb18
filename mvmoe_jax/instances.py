"""The Instance pytree, the paper's generators (Appendix A) and the x8 augmentation.

One ``Instance`` holds one problem with n customers; node 0 is the depot. A batch is the same pytree with
a leading batch axis on every field (``jax.tree.map(lambda x: x[i], batch)`` picks one instance). Variant
flags are arrays, so one compiled function serves all 16 variants and a batch may mix them.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mvmoe_jax import problems

# Raw vehicle capacity per problem size (paper, Appendix A); demands are raw integers in 1..9.
# Raw vehicle capacity by n: the paper's 20-200; 500 and 1000 follow the convention of Kool et al. (2019) and
# Hottung et al. (2022) that RL4CO and RouteFinder use, for instances beyond the paper's sizes.
CAPACITY_BY_SIZE = {20: 30.0, 50: 40.0, 100: 50.0, 200: 70.0, 500: 100.0, 1000: 150.0}
BACKHAUL_RATIO = 0.2
ROUTE_LIMIT = 3.0
DEPOT_CLOSE = 3.0        # the depot's time window is [0, 3]
SERVICE_TIME = 0.2
TW_HALF_WIDTH = (0.1, 1.0)
TW_ACCEPT_EPS = 1e-5     # the reference generator's round-off allowance in its acceptance test


@struct.dataclass
class Instance:
    """One VRP instance (a batch adds a leading axis to every field).

    Fields (shapes for one instance, n customers):
      locs:         float32 (n+1, 2)  depot first, coordinates in the unit square.
      demand:       float32 (n+1,)    raw demand / capacity; backhauls < 0; depot 0.
      service_time: float32 (n+1,)    0 without TW; depot 0.
      tw_start:     float32 (n+1,)    0 without TW.
      tw_end:       float32 (n+1,)    0 without TW; the depot's entry is its closing time (3) with TW.
      route_limit:  float32 ()        the route length limit with L, +inf without.
      is_open, has_backhaul, has_limit, has_tw: bool ()  the variant's flags.
      backhaul_rule: int8 ()          how linehauls and backhauls share a route: an index into
                                      ``problems.BACKHAUL_RULES`` (0 paper, 1 classic, 2 mixed).
    """

    locs: jax.Array
    demand: jax.Array
    service_time: jax.Array
    tw_start: jax.Array
    tw_end: jax.Array
    route_limit: jax.Array
    is_open: jax.Array
    has_backhaul: jax.Array
    has_limit: jax.Array
    has_tw: jax.Array
    backhaul_rule: jax.Array

    @property
    def num_customers(self) -> int:
        return self.locs.shape[-2] - 1

    @property
    def flags(self) -> jax.Array:
        """bool (..., 4): (O, B, L, TW)."""
        return jnp.stack([self.is_open, self.has_backhaul, self.has_limit, self.has_tw], axis=-1)


def batch_size(inst: Instance) -> int:
    """Leading batch size of a batched instance."""
    if inst.locs.ndim != 3:
        raise ValueError(f"expected a batched Instance (locs of shape (batch, n+1, 2)), got {inst.locs.shape}")
    return inst.locs.shape[0]


def variant_names(inst: Instance) -> list[str]:
    """Names of the variants in a single or batched instance (host-side)."""
    flags = np.asarray(inst.flags).reshape(-1, 4)
    return [problems.variant_from_flags(*f).name for f in flags]


def take(inst: Instance, index) -> Instance:
    """Select along the batch axis (an int, slice or index array)."""
    return jax.tree.map(lambda x: x[index], inst)


def stack(instances: Sequence[Instance]) -> Instance:
    """Stack single instances (same n) into a batch."""
    sizes = {i.locs.shape for i in instances}
    if len(sizes) != 1:
        raise ValueError(f"cannot stack instances of different sizes: {sorted(sizes)}")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *instances)


def concatenate(batches: Sequence[Instance]) -> Instance:
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)


def _require_finite(**fields) -> None:
    """Raises ValueError naming the first given field (None: not given) holding a NaN or an infinity: a
    NaN coordinate would make every distance from its node NaN and the decoding silently meaningless."""
    for name, value in fields.items():
        if value is not None and not np.all(np.isfinite(np.asarray(value, np.float64))):
            raise ValueError(f"{name} holds non-finite values (NaN or infinity)")


def from_arrays(depot_xy, node_xy, demand, capacity, *, variant, route_limit=None, service_time=None,
                tw_start=None, tw_end=None, depot_close=DEPOT_CLOSE, backhaul_rule="paper") -> Instance:
    """Build a batched Instance from per-field numpy arrays with a leading batch axis.

    depot_xy (B, 2), node_xy (B, n, 2), demand (B, n) raw (backhauls negative), capacity (B,) or scalar,
    route_limit (B,) or scalar (L only), service_time / tw_start / tw_end (B, n) (TW only), depot_close
    (B,) or scalar: the depot's closing time; backhaul_rule: a name or index of ``problems.BACKHAUL_RULES``.
    """
    var = problems.get_variant(variant)
    rule = problems.backhaul_rule_index(backhaul_rule)
    depot_xy = np.asarray(depot_xy, np.float32).reshape(-1, 1, 2)
    node_xy = np.asarray(node_xy, np.float32)
    if node_xy.ndim != 3 or node_xy.shape[-1] != 2:
        raise ValueError(f"node_xy must have shape (batch, n, 2), got {node_xy.shape}")
    bsz, n = node_xy.shape[:2]
    if depot_xy.shape[0] != bsz:
        raise ValueError(f"depot_xy has {depot_xy.shape[0]} rows for {bsz} instances")
    demand = np.asarray(demand, np.float64)
    if demand.shape != (bsz, n):
        raise ValueError(f"demand must have shape {(bsz, n)}, got {demand.shape}")
    _require_finite(depot_xy=depot_xy, node_xy=node_xy, demand=demand, capacity=capacity,
                    service_time=service_time, tw_start=tw_start, tw_end=tw_end)
    capacity = np.broadcast_to(np.asarray(capacity, np.float64), (bsz,))
    if np.any(capacity <= 0):
        raise ValueError("capacity must be positive")
    if not var.backhaul and np.any(demand < 0):
        raise ValueError(f"negative (backhaul) demands in a {var.name} instance; use a B variant")
    zeros = np.zeros((bsz, 1), np.float32)
    norm_demand = (demand / capacity[:, None]).astype(np.float32)
    if var.tw:
        if service_time is None or tw_start is None or tw_end is None:
            raise ValueError(f"{var.name} needs service_time, tw_start and tw_end")
        close = np.broadcast_to(np.asarray(depot_close, np.float32), (bsz,))[:, None]
        svc = np.concatenate([zeros, np.asarray(service_time, np.float32).reshape(bsz, n)], 1)
        tws = np.concatenate([zeros, np.asarray(tw_start, np.float32).reshape(bsz, n)], 1)
        twe = np.concatenate([close, np.asarray(tw_end, np.float32).reshape(bsz, n)], 1)
    else:
        svc = tws = twe = np.zeros((bsz, n + 1), np.float32)
    if var.limit:
        if route_limit is None:
            raise ValueError(f"{var.name} needs a route_limit")
        limit = np.broadcast_to(np.asarray(route_limit, np.float32), (bsz,)).copy()
    else:
        limit = np.full((bsz,), np.inf, np.float32)
    flag = lambda f: np.full((bsz,), f, bool)
    return Instance(
        locs=jnp.asarray(np.concatenate([depot_xy, node_xy], 1)),
        demand=jnp.asarray(np.concatenate([zeros, norm_demand], 1)),
        service_time=jnp.asarray(svc), tw_start=jnp.asarray(tws), tw_end=jnp.asarray(twe),
        route_limit=jnp.asarray(limit),
        is_open=jnp.asarray(flag(var.open)), has_backhaul=jnp.asarray(flag(var.backhaul)),
        has_limit=jnp.asarray(flag(var.limit)), has_tw=jnp.asarray(flag(var.tw)),
        backhaul_rule=jnp.asarray(np.full((bsz,), rule, np.int8)))


def with_backhaul_rule(inst: Instance, rule: str | int) -> Instance:
    """``inst`` (single or batched) with every instance under the backhaul ``rule`` (a name or index)."""
    index = problems.backhaul_rule_index(rule)
    return inst.replace(backhaul_rule=jnp.full(jnp.shape(inst.backhaul_rule), index, jnp.int8))


def backhaul_rule_names(inst: Instance) -> list[str]:
    """The backhaul rule of each instance of a single or batched Instance (host-side)."""
    return [problems.BACKHAUL_RULES[int(r)] for r in np.asarray(inst.backhaul_rule).reshape(-1)]


# ----------------------------------------------------------------------------------------------------
# Generation (paper, Appendix A)
# ----------------------------------------------------------------------------------------------------

def _check_size(num_customers: int) -> float:
    if num_customers not in CAPACITY_BY_SIZE:
        raise ValueError(f"problem size must be one of {sorted(CAPACITY_BY_SIZE)} (the sizes with a defined "
                         f"vehicle capacity), got {num_customers}")
    return CAPACITY_BY_SIZE[num_customers]


def generate_instance(key: jax.Array, flags: jax.Array, num_customers: int, backhaul_rule=0) -> Instance:
    """Generate one instance of the variant given by ``flags`` (bool (4,): O, B, L, TW) under the backhaul rule
    ``backhaul_rule`` (int (), an index of ``problems.BACKHAUL_RULES``; the draw does not depend on it).

    A time-window instance with a customer that cannot be served on a route of its own (one farther than
    1.4 from the depot has no time to get there, be served and return by 3) is drawn again, with
    ``fold_in(key, attempt)``, as the reference generator redraws such batches; the first draw uses ``key``.
    jit-able with ``num_customers`` static; vmap over keys and flags to build batches.
    """
    def draw(attempt):
        k = jax.lax.cond(attempt == 0, lambda: key, lambda: jax.random.fold_in(key, attempt))
        return _draw_instance(k, flags, num_customers).replace(backhaul_rule=jnp.asarray(backhaul_rule, jnp.int8))

    def unservable(carry):
        return ~all_customers_servable(carry[1])

    def again(carry):
        attempt = carry[0] + 1
        return attempt, draw(attempt)

    return jax.lax.while_loop(unservable, again, (jnp.int32(0), draw(jnp.int32(0))))[1]


def all_customers_servable(inst: Instance) -> jax.Array:
    """bool (): the reference generator's acceptance test for one instance. With TW every customer i must
    allow depot -> i -> depot in time: ``max(d_0i, tw_start_i) + service_i + d_0i <= tw_end_0 + 1e-5``."""
    d0 = jnp.sqrt(jnp.sum((inst.locs[1:] - inst.locs[0]) ** 2, axis=-1))
    back = jnp.maximum(d0, inst.tw_start[1:]) + inst.service_time[1:] + d0
    return ~inst.has_tw | jnp.all(back <= inst.tw_end[0] + TW_ACCEPT_EPS)


def _draw_instance(key: jax.Array, flags: jax.Array, num_customers: int) -> Instance:
    """One draw of the paper's generator, before the acceptance test."""
    capacity = _check_size(num_customers)
    n = num_customers
    flags = jnp.asarray(flags, bool)
    k_xy, k_dem, k_back, k_centre, k_width = jax.random.split(key, 5)
    locs = jax.random.uniform(k_xy, (n + 1, 2), jnp.float32)
    raw = jax.random.randint(k_dem, (n,), 1, 10).astype(jnp.float32)
    # B: floor(0.2 n) customers, chosen uniformly, become backhauls.
    num_back = int(n * BACKHAUL_RATIO)
    is_back = jnp.zeros((n,), bool).at[jax.random.permutation(k_back, n)[:num_back]].set(True)
    raw = jnp.where(flags[1] & is_back, -raw, raw)
    demand = jnp.concatenate([jnp.zeros((1,), jnp.float32), raw / capacity])

    # TW: service 0.2, centre ~ U(d_0i, 3 - d_0i - s), half width ~ U(0.1, 1), clipped to [0, 3].
    d0 = jnp.sqrt(jnp.sum((locs[1:] - locs[0]) ** 2, axis=-1))
    svc = jnp.full((n,), SERVICE_TIME, jnp.float32)
    u_c = jax.random.uniform(k_centre, (n,), jnp.float32)
    centre = d0 + (DEPOT_CLOSE - d0 - svc - d0) * u_c
    half = jax.random.uniform(k_width, (n,), jnp.float32, *TW_HALF_WIDTH)
    tws = jnp.maximum(0.0, centre - half)
    twe = jnp.minimum(DEPOT_CLOSE, centre + half)
    tw = flags[3]
    zero1 = jnp.zeros((1,), jnp.float32)
    svc = jnp.where(tw, jnp.concatenate([zero1, svc]), 0.0)
    tws = jnp.where(tw, jnp.concatenate([zero1, tws]), 0.0)
    twe = jnp.where(tw, jnp.concatenate([jnp.full((1,), DEPOT_CLOSE, jnp.float32), twe]), 0.0)
    return Instance(
        locs=locs, demand=demand, service_time=svc, tw_start=tws, tw_end=twe,
        route_limit=jnp.where(flags[2], jnp.float32(ROUTE_LIMIT), jnp.float32(jnp.inf)),
        is_open=flags[0], has_backhaul=flags[1], has_limit=flags[2], has_tw=flags[3],
        backhaul_rule=jnp.int8(problems.PAPER_RULE))


def generate(key: jax.Array, batch: int, num_customers: int,
             variants: str | problems.Variant | Sequence[str | problems.Variant],
             backhaul_rule: str | int | Sequence[str | int] = "paper") -> Instance:
    """Generate a batch of ``batch`` instances with n = ``num_customers``.

    ``variants`` is one variant (every instance of that kind) or a sequence of variants (each instance
    draws one uniformly: a mixed-variant batch). ``backhaul_rule``: one rule for every instance, or a sequence
    of rules, instance i taking rule ``i % len(rules)`` (names or indices of ``problems.BACKHAUL_RULES``).
    The instances drawn do not depend on the rule. Deterministic in ``key``.
    """
    rules = [backhaul_rule] if isinstance(backhaul_rule, (str, int, np.integer)) else list(backhaul_rule)
    if not rules:
        raise ValueError("backhaul_rule: give at least one rule")
    codes = np.array([problems.backhaul_rule_index(r) for r in rules], np.int8)
    if isinstance(variants, (str, problems.Variant)):
        names = [problems.get_variant(variants)]
    else:
        names = problems.parse_variants(list(variants))
    _check_size(num_customers)
    table = jnp.asarray(problems.flags_array(names))
    k_var, k_inst = jax.random.split(key)
    choice = jax.random.randint(k_var, (batch,), 0, len(names))
    rule = jnp.asarray(np.resize(codes, batch))
    return _generate_batch(jax.random.split(k_inst, batch), table[choice], num_customers, rule)


@partial(jax.jit, static_argnums=2)
def _generate_batch(keys: jax.Array, flags: jax.Array, num_customers: int, rules: jax.Array) -> Instance:
    return jax.vmap(generate_instance, in_axes=(0, 0, None, 0))(keys, flags, num_customers, rules)


# ----------------------------------------------------------------------------------------------------
# x8 augmentation (the 8 symmetries of the unit square)
# ----------------------------------------------------------------------------------------------------

def augment_xy_8(xy: jax.Array) -> jax.Array:
    """(..., 2) -> (8, ..., 2): the 8 symmetries of the unit square, identity first, in the reference's
    order (x,y), (1-x,y), (x,1-y), (1-x,1-y), (y,x), (1-y,x), (y,1-x), (1-y,1-x)."""
    x, y = xy[..., 0], xy[..., 1]
    pairs = [(x, y), (1 - x, y), (x, 1 - y), (1 - x, 1 - y), (y, x), (1 - y, x), (y, 1 - x), (1 - y, 1 - x)]
    return jnp.stack([jnp.stack(p, axis=-1) for p in pairs])


def augment_8(inst: Instance) -> Instance:
    """Single or batched Instance -> the same with a new leading axis of 8 augmentations.

    Only coordinates change; every distance (so every mask and cost) is preserved.
    """
    aug = jax.tree.map(lambda x: jnp.broadcast_to(x, (8,) + x.shape), inst)
    return aug.replace(locs=augment_xy_8(inst.locs))
