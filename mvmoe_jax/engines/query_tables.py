"""The query fusion's score tables (plan fields ``fused_query``, ``query_table_multiple``,
``query_table_max_columns``, ``score_bound_instances``; reference: ``Policy.decode``'s query projection and
per-head query-key products at every step).

A step's query is ``[emb_current, dynamic] @ Wq``, linear in its parts, and the current node is one of N.
Scoring every node's embedding part against the keys once per rollout (N x N per head) and each dynamic
feature's part (F x N) leaves a step a row gather and F multiply-adds instead of the projection and the
products (docs/performance.md, "Fused readout and query"). From the tables' row maxima and ranges a step also
bounds its largest score from above without a pass over its scores (``score_bound``), which
``engines.attention.attention_from_bounded_scores`` offsets the softmax by.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mvmoe_jax.execution import ExecutionPlan
from mvmoe_jax.nn.attention import split_heads


def query_table_width(num_nodes: int, plan: ExecutionPlan) -> int:
    """Columns of the query fusion's score tables and padded values where ``Policy.precompute`` pads them for
    forward-only decoding: ``num_nodes`` rounded up to the plan's ``query_table_multiple`` where that gives at
    most ``query_table_max_columns`` columns (0: any), else unchanged. The padding columns are masked off, so
    each step's exponentials, row sums and value products see exact zeros there: the same sums, to float32
    rounding. A step's loops and YNNPACK's value products run faster on rows of a multiple of 8 floats while
    they stay in cache; past 128 columns (n = 200) the padding lost (docs/performance.md, "Fused readout and
    query")."""
    padded = -(-num_nodes // plan.query_table_multiple) * plan.query_table_multiple
    if plan.query_table_max_columns and padded > plan.query_table_max_columns:
        return num_nodes
    return padded


def with_score_tables(cache, kernel: jax.Array, num_heads: int, dtype: Any, padded_for: ExecutionPlan | None = None):
    """``cache`` (a ``DecoderCache``) with its query tables: node_scores (B, H, N, W), feature_scores
    (B, H, F, W), node_score_max (B, H, N) and feature_score_range (B, H, F, 2), from the query projection's
    ``kernel`` (D + F, D) and the cache's embeddings and keys. ``padded_for``: the plan whose
    ``query_table_width`` the tables are widened to, with ``padded_values`` set, for forward-only decoding
    (zero columns past N, masked off by the steps); None: W = N. The cache's steps then attend on the
    forward-only ``"score_tables"`` path (its ``node_queries``, if any, dropped)."""
    d = kernel.shape[-1]
    scale = 1.0 / jnp.sqrt(jnp.float32(d // num_heads))
    node_q = split_heads(jnp.matmul(cache.embeddings.astype(dtype), kernel[:d],
                                    preferred_element_type=jnp.float32), num_heads)     # (B, H, N, d/H)
    keys = cache.keys.astype(dtype)
    node_scores = jnp.einsum("bhid,bhjd->bhij", node_q.astype(dtype), keys, preferred_element_type=jnp.float32) * scale
    feature_q = kernel[d:].reshape(-1, num_heads, d // num_heads)                          # (F, H, d/H)
    feature_scores = jnp.einsum("fhd,bhjd->bhfj", feature_q, keys, preferred_element_type=jnp.float32) * scale
    feature_score_range = jnp.stack([jnp.min(feature_scores, axis=-1), jnp.max(feature_scores, axis=-1)], axis=-1)
    cache = cache.replace(node_scores=node_scores, feature_scores=feature_scores, node_queries=None,
                          node_score_max=jnp.max(node_scores, axis=-1), feature_score_range=feature_score_range,
                          attention="score_tables")
    n = node_scores.shape[-1]
    extra = 0 if padded_for is None else query_table_width(n, padded_for) - n
    if not extra:
        return cache
    widen = lambda x, axis: jnp.pad(x, [(0, extra if a == axis % x.ndim else 0) for a in range(x.ndim)])
    return cache.replace(node_scores=widen(node_scores, -1), feature_scores=widen(feature_scores, -1),
                         padded_values=widen(cache.values, -2))


def gathered_scores(cache, current: jax.Array, dynamic: jax.Array, width: int | None = None) -> jax.Array:
    """(B, H, P, W) a step's scaled attention scores: the current node's row of ``node_scores`` plus each
    dynamic feature's row of ``feature_scores``, their first ``width`` columns (default all).
    current int (B, P); dynamic (B, P, F)."""
    width = cache.node_scores.shape[-1] if width is None else width
    score = jax.vmap(lambda table, cur: table[:, cur, :width])(cache.node_scores, current.astype(jnp.int32))
    dyn = dynamic.astype(jnp.float32)
    for f in range(dyn.shape[-1]):
        score = score + dyn[:, None, :, f, None] * cache.feature_scores[:, :, f, None, :width]
    return score


def score_bound(cache, current: jax.Array, dynamic: jax.Array) -> jax.Array:
    """(B, H, P, 1): an upper bound on each step's largest attention score,
    ``node_score_max[current] + sum_f max(dynamic_f * min_f, dynamic_f * max_f)``, for the forward steps that
    keep no softmax weights (inference and evaluation's sampling). How loose the bounds get in practice:
    docs/performance.md, "Score bounds"."""
    bound = jax.vmap(lambda table, cur: table[:, cur])(cache.node_score_max, current.astype(jnp.int32))
    dyn = dynamic.astype(jnp.float32)
    for f in range(dyn.shape[-1]):
        d = dyn[:, None, :, f]                                                            # (B, 1, P)
        low, high = cache.feature_score_range[:, :, f, None, 0], cache.feature_score_range[:, :, f, None, 1]
        bound = bound + jnp.maximum(d * low, d * high)
    return bound[..., None]
