"""The decoder step's attention on the paths that the query fusion opens (plan field ``fused_query``;
reference: ``Policy.projected_attention``, the query projected from ``[emb_current, dynamic]`` and attended
over the keys and values).

Which path a step takes is named by the cache it reads (``DecoderCache.attention``), set where the cache is
built:

- ``"projected"``: the reference's query projection (no fusion, or a cache without its tables);
- ``"hoisted_query"``: the query's node part projected once per rollout (``node_queries``), so that a step
  gathers a row and adds the dynamic features' part; differentiable (training's replay and backward pass);
- ``"score_tables"``: forward only; a step gathers its attention scores from the query fusion's tables
  (``engines.query_tables``), padded to a width the step's loops run fast on, and offsets its softmax by a
  bound from the tables' maxima where the plan asks (``score_bound_instances``);
- ``"given_scores"``: training's backward pass; the scores are gathered from the tables (given, without
  gradient) while the gradient flows through the hoisted query and the keys
  (``engines.attention.attention_with_given_scores``): no query-key product per step.

Independently of the path, a step can keep its softmax weights for a ``DecoderRecord`` (``keep_weights``,
forward only) or take the whole forward pass from such a record (``given``), computing only its query, for
the stepwise backward pass (``engines.stepwise_backward``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mvmoe_jax.engines import attention as attention_engines, query_tables
from mvmoe_jax.nn.attention import multi_head_attention, split_heads

PATHS = ("projected", "hoisted_query", "score_tables", "given_scores")


def step_query(policy, cache, current: jax.Array, dynamic: jax.Array) -> jax.Array:
    """(B, H, P, D/H) a step's multi-head query: from the hoisted node part (``node_queries``) where the cache
    holds it, else projected as the reference does. current int (B, P); dynamic (B, P, F)."""
    cfg = policy.cfg
    if cache.attention in ("hoisted_query", "given_scores"):
        kernel = policy.query_kernel()                                                    # (D + F, D)
        rows = jnp.take_along_axis(cache.node_queries, current[..., None].astype(jnp.int32), axis=1)
        query = rows + jnp.einsum("bpf,fd->bpd", dynamic.astype(cfg.dtype), kernel[cfg.embedding_dim:],
                                  preferred_element_type=jnp.float32)                     # (B, P, D)
    else:
        query = policy.projected_query(cache.embeddings, current, dynamic)
    return split_heads(query, cfg.num_heads)


def attend(policy, cache, current: jax.Array, dynamic: jax.Array, mask: jax.Array, keep_weights: bool = False,
           given=None) -> tuple[jax.Array, jax.Array | None]:
    """The decoder's attention output (B, P, D) on the cache's path, and (``keep_weights``) its softmax weights
    as a record keeps them (else None). ``given``: a ``DecoderRecord`` whose output and weights are taken."""
    plan = policy.plan
    if cache.attention not in PATHS:
        raise ValueError(f"unknown decoder attention path {cache.attention!r}; known: {', '.join(PATHS)}")
    if given is not None:
        q = step_query(policy, cache, current, dynamic)
        return attention_engines.attention_with_given_weights(q, cache.keys, cache.values, given.attention_weights,
                                                              given.attention, plan), None
    if cache.attention == "score_tables":
        return _from_score_tables(policy, cache, current, dynamic, mask, keep_weights)
    if cache.attention == "given_scores" and not keep_weights:
        scores = query_tables.gathered_scores(cache, current, dynamic, mask.shape[-1])
        q = step_query(policy, cache, current, dynamic)
        return attention_engines.attention_with_given_scores(q, cache.keys, cache.values, scores, mask, plan), None
    q = step_query(policy, cache, current, dynamic)
    if keep_weights:
        scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
        score = jnp.einsum("bhmd,bhnd->bhmn", q, cache.keys, preferred_element_type=jnp.float32) * scale
        return attention_engines.attention_from_scores(score, cache.values, mask, plan, with_weights=True)
    return multi_head_attention(q, cache.keys, cache.values, mask, plan=plan), None


def _from_score_tables(policy, cache, current, dynamic, mask, keep_weights: bool):
    """Forward only: the scores gathered from the tables. Where the tables are padded (``padded_values`` set)
    and no weights are kept, the step reads them whole with the padded values, the padding columns masked
    off; otherwise their first N columns."""
    plan = policy.plan
    num_nodes = mask.shape[-1]
    if keep_weights:
        scores = query_tables.gathered_scores(cache, current, dynamic, num_nodes)
        return attention_engines.attention_from_scores(scores, cache.values, mask, plan, with_weights=True)
    values = cache.values
    if cache.padded_values is not None:
        values = cache.padded_values
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, values.shape[-2] - num_nodes)))
    scores = lambda: query_tables.gathered_scores(cache, current, dynamic, values.shape[-2])
    # On a CPU the bounds pay for one instance at a time; in larger chunks YNNPACK runs the maximum, the
    # exponentials, the value product and the normalisation as one kernel, which the bounded loop's
    # exponentials break up (docs/performance.md, "Score bounds").
    if cache.node_score_max is not None and current.shape[0] <= plan.score_bound_instances:
        bound = query_tables.score_bound(cache, current, dynamic)
        return attention_engines.attention_from_bounded_scores(scores, values, mask, bound, plan), None
    return attention_engines.attention_from_scores(scores(), values, mask, plan), None
