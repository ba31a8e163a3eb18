"""Distance-aware decoding: the two options of ``PolicyConfig`` that use where the nodes lie, for instances
larger than the training ones, applied to trained weights at inference (off by default: the decoder is then
the paper's, bit for bit).

- ``distance_bias`` (alpha): ``-alpha * log2(n) * d(current, j)`` added to the decoder's logits after the
  ``C tanh`` clipping, before the mask and the softmax (n customers, d the Euclidean distance in the unit
  square). The choice's distribution becomes the policy's times the prior ``exp(-alpha log2(n) d)``, which
  favours near nodes more as n grows (the adaptation term of ICAM, Zhou et al. 2024; DAR, Wang et al. 2024,
  applies such a term to trained weights). The multi-head attention before it is left as trained. With
  ``learned_distance_bias`` alpha is a parameter of the policy, trained with the rest (``configs/mvmoe_sizes.py``).
- ``candidates`` (k): the choice restricted to the k customers nearest the current node among the feasible
  ones (by distance, ties by index); the depot stays choosable wherever it is feasible. The set is empty only
  when no customer is feasible, so feasibility never depends on k, and for k >= n it is every feasible node:
  the full decoder's choice. Only the choice is restricted; the attention still reads every feasible node, as
  in training. Each node's neighbours are ranked once per rollout (``neighbour_ranks``); a step then finds
  the k-th nearest feasible customer by a bisection over ranks, log2(N) counting passes over its row, where
  ``jax.lax.top_k`` or a sort of the row per step cost more than the rest of the step on a CPU
  (docs/performance.md, "Candidate sets").

Both act on the scores of one decoding step (``Policy.decode``), after the attention and the readout, so
every execution plan's forms of those (``mvmoe_jax.engines``) carry them unchanged. The coordinates are data:
no gradient flows into them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def current_distances(locs: jax.Array, current: jax.Array) -> jax.Array:
    """(B, P, N) float32 Euclidean distances from each trajectory's current node to every node.
    locs (B, N, 2); current int (B, P)."""
    locs = jax.lax.stop_gradient(locs.astype(jnp.float32))
    here = jnp.take_along_axis(locs, current[..., None].astype(jnp.int32), axis=1)            # (B, P, 2)
    dx = locs[:, None, :, 0] - here[..., 0, None]
    dy = locs[:, None, :, 1] - here[..., 1, None]
    return jnp.sqrt(dx * dx + dy * dy)


def distance_bias(distances: jax.Array, alpha: float | jax.Array) -> jax.Array:
    """(B, P, N) the logit bias ``-alpha * log2(n) * d`` of distances (B, P, N) over N = n + 1 nodes; alpha a
    number or a float32 scalar (a learned parameter: differentiable in it)."""
    num_customers = distances.shape[-1] - 1
    return -alpha * jnp.log2(jnp.float32(max(num_customers, 1))) * distances


def neighbour_ranks(locs: jax.Array) -> jax.Array:
    """(B, N, N) float32: entry (i, j) is j's place among all nodes ordered by their distance from i (0 for
    the nearest; ties by index). Float, not int, so that the decoder cache stays a pytree of float arrays for
    the backward passes that carry its cotangent; exact below 2^24 nodes. locs (B, N, 2)."""
    locs = jax.lax.stop_gradient(locs.astype(jnp.float32))
    dx = locs[:, None, :, 0] - locs[:, :, None, 0]
    dy = locs[:, None, :, 1] - locs[:, :, None, 1]
    order = jnp.argsort(dx * dx + dy * dy, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1).astype(jnp.float32)


def current_ranks(ranks: jax.Array, current: jax.Array) -> jax.Array:
    """(B, P, N) the rows of ``neighbour_ranks`` (B, N, N) of each trajectory's current node (B, P)."""
    return jax.vmap(lambda table, cur: table[cur])(ranks, current.astype(jnp.int32))


def candidate_mask(mask: jax.Array, ranks: jax.Array, k: int) -> jax.Array:
    """bool (B, P, N): ``mask`` (True = feasible; node 0 the depot) keeping, of the customers, only the ``k``
    nearest feasible ones, nearness given by ``ranks`` (B, P, N), each row a permutation of 0..N-1
    (``current_ranks``); all of them where fewer than k are feasible. The depot keeps its entry.

    The largest rank kept is found by bisection: the smallest t with min(k, feasible) customers of rank <= t."""
    if k < 1:
        raise ValueError(f"candidates must be a positive number of nodes, got {k}")
    feasible = mask[..., 1:]
    rank = jnp.where(feasible, ranks[..., 1:], jnp.float32(ranks.shape[-1]))
    target = jnp.minimum(jnp.sum(feasible, axis=-1, keepdims=True, dtype=jnp.int32), k)
    # Invariant: fewer than target customers within rank lo, at least target within rank hi.
    lo = jnp.full(target.shape, -1.0, jnp.float32)
    hi = jnp.full(target.shape, ranks.shape[-1] - 1.0, jnp.float32)
    for _ in range(max(1, (ranks.shape[-1]).bit_length())):
        mid = jnp.floor(0.5 * (lo + hi))
        enough = jnp.sum(rank <= mid, axis=-1, keepdims=True, dtype=jnp.int32) >= target
        lo, hi = jnp.where(enough, lo, mid), jnp.where(enough, mid, hi)
    return jnp.concatenate([mask[..., :1], feasible & (rank <= hi)], axis=-1)
