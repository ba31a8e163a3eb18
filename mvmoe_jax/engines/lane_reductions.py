"""Reductions over a decoding step's node axis in lanes (plan field ``lane_reductions``), for the greedy
choice's maximum and first index and sampling's first node past its threshold (``rollout.first_argmax``,
``rollout.first_true``; reference: ``jnp.max`` / ``jnp.min`` over the last axis).

XLA:CPU hands a maximum or minimum over a short last axis (a step's 51 or 101 nodes) to YNNPACK, which runs
it at a fraction of its speed on long rows. Combining the row's 16-wide slices elementwise first (one loop
that XLA vectorises) leaves a reduction over 16 lanes. Maxima and minima do not depend on the order they are
taken in, so the results are the same (see docs/performance.md, "Lane reductions").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Width of the lanes: 16 float32, one AVX-512 vector.
REDUCTION_LANES = 16

_REDUCTIONS = {jnp.maximum: jnp.max, jnp.minimum: jnp.min}


def reduces_in_lanes(num_nodes: int, lanes: bool) -> bool:
    """Whether a reduction over a last axis of ``num_nodes`` runs in lanes (``lane_reduce``): where the plan
    asks for it (``lanes``), for rows of at least two lanes (32 nodes); shorter rows, one lane and a remainder,
    gain nothing (see docs/performance.md, "Lane reductions")."""
    return lanes and num_nodes >= 2 * REDUCTION_LANES


def lane_reduce(x: jax.Array, op) -> jax.Array:
    """``x`` (..., N) reduced over its last axis by ``op`` (``jnp.maximum`` or ``jnp.minimum``), keeping the
    axis: (..., 1). The full ``REDUCTION_LANES``-wide slices are combined elementwise into one, whose lanes are
    then reduced, as is the remainder past the last full slice."""
    reduce = _REDUCTIONS[op]
    lanes, n = REDUCTION_LANES, x.shape[-1]
    full = n // lanes
    if not full:
        return reduce(x, axis=-1, keepdims=True)
    acc = x[..., :lanes]
    for j in range(1, full):
        acc = op(acc, x[..., j * lanes:(j + 1) * lanes])
    out = reduce(acc, axis=-1, keepdims=True)
    if n % lanes:
        out = op(out, reduce(x[..., full * lanes:], axis=-1, keepdims=True))
    return out


def node_reduce(x: jax.Array, op, lanes: bool) -> jax.Array:
    """``x`` (..., N) reduced over its last axis by ``op`` (as ``lane_reduce``), without the axis: (...,). In
    lanes where ``reduces_in_lanes(N, lanes)`` says so, else the plain reduction."""
    if reduces_in_lanes(x.shape[-1], lanes):
        return lane_reduce(x, op)[..., 0]
    return _REDUCTIONS[op](x, axis=-1)
