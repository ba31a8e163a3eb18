"""Faster forms of the decoder's and encoder's softmax attention (reference: ``nn.attention.multi_head_attention``).

Plan fields: ``attention_vjp`` (a written backward pass that keeps the softmax weights, instead of autodiff
through the softmax), its layouts ``products_against_transposes``, ``keys_major_weights`` and
``row_sums_from_output``, and the forward-only forms ``normalise_after_product`` and
``merge_heads_by_slices``. The query fusion's steps (``engines.query_tables``) take their scores from tables
(``attention_from_scores``, ``attention_from_bounded_scores``), and the training step's backward loop takes
them, or the whole forward pass, as given (``attention_with_given_scores``, ``attention_with_given_weights``).
Every form computes the softmax attention of the reference to float32 rounding.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from mvmoe_jax.execution import ExecutionPlan
import mvmoe_jax.nn.attention as plain


def merge_heads_by_slices(x: jax.Array) -> jax.Array:
    """``merge_heads`` written as the concatenation of the H heads' (..., n, d) slices along the last axis:
    the same array, which XLA:CPU builds faster than the transpose for a decoding step's small output
    (docs/performance.md, "Head merge by slices")."""
    return jnp.concatenate([x[..., h, :, :] for h in range(x.shape[-3])], axis=-1)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, plan: ExecutionPlan) -> jax.Array:
    """``plain.attention`` (B, H, m, d) with the written backward pass (``attention_backward``), whose forward
    pass keeps the softmax weights for it instead of autodiff's chain through the softmax."""
    return _attention(q, k, v, mask, plan)


def attention_normalised_after_product(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None
                                       ) -> jax.Array:
    """Forward-only ``plain.multi_head_attention`` (B, m, H*d) normalised after the value product: the
    softmax first writes the (B, H, m, n) weights in a pass of their own; normalised after, the exponentials
    feed the product and only the (B, H, m, d) output is divided, faster for the encoder's calls of many
    instances (docs/performance.md, "Normalisation after the value product").

    A plain function beside the custom-vjp one, never that one's primal: JAX's vmap of a custom-vjp call takes
    the outputs' batch axis from the primal function, and this form's output carries the batch on another axis
    than ``_attention_fwd``'s (``test_attention_value_is_the_same_under_a_gradient_in_a_batched_map``).
    """
    score = _masked(plain.scaled_scores(q, k), mask)
    _, total, out = _exponentials(score, jnp.max(score, axis=-1, keepdims=True), v)
    # Merged by the transpose: for the encoder's (B, H, n, d) the slices were slower.
    return plain.merge_heads((out / total).astype(v.dtype))


def attention_from_scores(score: jax.Array, v: jax.Array, mask: jax.Array | None, plan: ExecutionPlan,
                          with_weights: bool = False):
    """The attention (B, m, H*d) from its scaled scores (B, H, m, n), forward only, normalised after the
    value product (a division per output element rather than per weight). ``with_weights``: also return the
    softmax weights float32 for a later ``attention_with_given_weights``, in the layout records keep
    (``kept_layout``)."""
    score = _masked(score, mask)
    unnormalised, total, out = _exponentials(score, jnp.max(score, axis=-1, keepdims=True), v)
    out = _merged(out / total, v.dtype, plan)
    return (out, kept_layout(unnormalised / total, plan)) if with_weights else out


# ``attention_from_bounded_scores`` keeps the bounded result only if every row's exponentials sum to at least this,
# i.e. if no bound lies more than ~46 above its row's largest score: every term that matters at float32 precision
# is then a normal number, so the result is the softmax's up to rounding.
MIN_BOUNDED_ROW_TOTAL = 1e-20


def attention_from_bounded_scores(scores: Callable[[], jax.Array], v: jax.Array, mask: jax.Array | None,
                                  row_bound: jax.Array, plan: ExecutionPlan) -> jax.Array:
    """``attention_from_scores(scores(), v, mask)`` with each row's exponentials taken against ``row_bound``
    (B, H, m, 1), an upper bound on the row's largest score known beforehand, instead of the row's maximum.

    The softmax is the same for any offset; without the maximum XLA computes the scores, masks them and takes
    their exponentials in one loop. Should some row's exponentials sum to less than ``MIN_BOUNDED_ROW_TOTAL``
    (its bound too loose), the whole call is computed again against the maximum, in a branch that runs only
    then; ``scores`` is called again there, so that the bounded path need not keep the scores for it.
    """
    score = _masked(scores(), mask)
    _, total, out = _exponentials(score, row_bound.astype(jnp.float32), v)
    out = _merged(out / total, v.dtype, plan)      # outside the branch: XLA:CPU runs a branch's work less well
    failed = jnp.max((total < MIN_BOUNDED_ROW_TOTAL).astype(jnp.int32))
    # The branch takes the mask negated and negates it back: a feasibility mask arrives as ``~any(rules)``,
    # and XLA folds the double negation, handing the branch the rules' reduction instead of materialising
    # its negation each step (docs/performance.md, "Score bounds").
    blocked = None if mask is None else ~mask

    def fallback(blocked):
        return attention_from_scores(scores(), v, None if blocked is None else ~blocked, plan)

    return jax.lax.switch(failed, (lambda blocked: out, fallback), blocked)


def _masked(score: jax.Array, mask: jax.Array | None) -> jax.Array:
    """float32 scores (B, H, m, n), -inf where ``mask`` (B, m, n) is False."""
    if mask is not None:
        score = jnp.where(mask[:, None], score, -jnp.inf)
    return score.astype(jnp.float32)


def _exponentials(score: jax.Array, offset: jax.Array, v: jax.Array):
    """(exp(score - offset) (B, H, m, n), their row sums (B, H, m, 1), their product with the values
    (B, H, m, d) float32): the softmax before its normalisation."""
    unnormalised = jnp.exp(score - offset)
    out = jnp.einsum("bhmn,bhnd->bhmd", unnormalised.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return unnormalised, jnp.sum(unnormalised, axis=-1, keepdims=True), out


def _merged(out: jax.Array, dtype, plan: ExecutionPlan) -> jax.Array:
    """The normalised (B, H, m, d) output as (B, m, H*d) ``dtype``, merged as the plan says."""
    out = out.astype(dtype)
    return merge_heads_by_slices(out) if plan.merge_heads_by_slices else plain.merge_heads(out)


def attention_with_given_scores(q: jax.Array, k: jax.Array, v: jax.Array, score: jax.Array,
                                mask: jax.Array | None, plan: ExecutionPlan) -> jax.Array:
    """``plain.multi_head_attention(q, k, v, mask)`` whose forward pass takes the scaled scores (B, H, m, n)
    as given (gathered from the query fusion's tables) instead of multiplying q and k again. The backward
    pass is the attention's: cotangents for q, k and v as if the scores had been computed from them, none
    for ``score`` (it must depend on nothing differentiated except through q and k). Returns (B, m, H*d)."""
    return plain.merge_heads(_attention_given_scores(q, k, v, score, mask, plan))


def attention_with_given_weights(q: jax.Array, k: jax.Array, v: jax.Array, weights: jax.Array,
                                 out: jax.Array, plan: ExecutionPlan) -> jax.Array:
    """``plain.multi_head_attention(q, k, v, mask)`` whose forward pass is given: its softmax weights (in the
    layout of ``kept_layout``) and output (B, m, H*d), recorded when the same attention ran before (training's
    sampling pass). Returns ``out``; the backward pass is the attention's, none for the record, with the
    softmax backward's row sums taken from ``out`` where ``plan.row_sums_from_output``."""
    return _attention_given_weights(q, k, v, weights, out, plan)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention_given_weights(q, k, v, weights, out, plan):
    return out


def _attention_given_weights_fwd(q, k, v, weights, out, plan):
    return out, ((q, k, v, weights), out)


def _attention_given_weights_bwd(plan, residuals, g):
    attention_residuals, out = residuals
    num_heads = attention_residuals[0].shape[1]
    row_sums = output_row_sums(g, out, num_heads) if plan.row_sums_from_output else None
    backward = _attention_bwd_keys_major if plan.keys_major_weights else _attention_bwd
    dq, dk, dv, _ = backward(plan, attention_residuals, plain.split_heads(g, num_heads), row_sums)
    return dq, dk, dv, None, None


_attention_given_weights.defvjp(_attention_given_weights_fwd, _attention_given_weights_bwd)


def output_row_sums(g: jax.Array, out: jax.Array, num_heads: int) -> jax.Array:
    """The softmax backward's row sums ``sum_n dW[..., n] * W[..., n]`` (B, H, m, 1) from the output ``out``
    (B, m, H*d) and its cotangent ``g``: as ``dW = g_h @ v_h^T`` and ``out_h = W @ v_h``, each row's sum equals
    ``sum_d g_h[..., d] * out_h[..., d]`` (FlashAttention's form), without a pass over the weights
    (docs/performance.md, "Attention backward layouts")."""
    b, m, hd = g.shape
    per_head = jnp.sum((g.astype(jnp.float32) * out.astype(jnp.float32)).reshape(b, m, num_heads, hd // num_heads),
                       axis=-1)
    return jnp.swapaxes(per_head, -1, -2)[..., None]


def kept_layout(weights: jax.Array, plan: ExecutionPlan) -> jax.Array:
    """Queries-major softmax weights (B, H, m, n) in the layout records keep, and back: keys-major (B, H, n, m)
    where ``plan.keys_major_weights`` (the map is its own inverse).

    Keys-major, the backward pass forms the score cotangent keys-major too: the value and key cotangents
    become plain products and the query's the one with a transposed operand; chosen where such products are
    left to XLA (AVX-512 CPUs, docs/performance.md, "Attention backward layouts"). Only the record: where
    the backward pass recomputes the weights in its own step, a transposed copy costs a pass of its own."""
    return jnp.swapaxes(weights, -1, -2) if plan.keys_major_weights else weights


def _attention_fwd(q, k, v, mask, plan):
    """(B, H, m, d) output and the residuals (q, k, v, softmax weights) of the backward pass."""
    out, weights = plain.weighted_values(plain.scaled_scores(q, k), v, mask)
    return out, (q, k, v, weights)


def _attention_bwd(plan, residuals, g, row_sums=None):
    """The softmax-attention gradients from the residuals (q, k, v, queries-major softmax weights). The two
    products that contract over the queries (dk, dv) run against explicitly transposed operands where
    ``plan.products_against_transposes`` (AVX2 CPUs and accelerators: XLA:CPU runs transposed-operand products
    outside its fast matmul library there), else as products with a transposed operand, left to XLA.
    ``row_sums`` (B, H, m, 1): the softmax backward's ``sum(dW * W)`` when known otherwise."""
    q, k, v, weights = residuals
    f32 = jnp.float32
    g, weights = g.astype(f32), weights.astype(f32)
    scale = 1.0 / jnp.sqrt(f32(q.shape[-1]))
    d_weights = jnp.einsum("bhmd,bhnd->bhmn", g, v.astype(f32))
    if row_sums is None:
        row_sums = jnp.sum(d_weights * weights, axis=-1, keepdims=True)
    d_score = weights * (d_weights - row_sums) * scale
    dq = jnp.einsum("bhmn,bhnd->bhmd", d_score, k.astype(f32))
    if plan.products_against_transposes:
        # optimization_barrier keeps XLA from folding the transposes back into the dots.
        weights_t, d_score_t = jax.lax.optimization_barrier((jnp.swapaxes(weights, -1, -2),
                                                             jnp.swapaxes(d_score, -1, -2)))
        dv = jnp.einsum("bhnm,bhmd->bhnd", weights_t, g)
        dk = jnp.einsum("bhnm,bhmd->bhnd", d_score_t, q.astype(f32))
    else:
        dv = jnp.einsum("bhmn,bhmd->bhnd", weights, g)
        dk = jnp.einsum("bhmn,bhmd->bhnd", d_score, q.astype(f32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def _attention_bwd_keys_major(plan, residuals, g, row_sums=None):
    """``_attention_bwd`` for keys-major weights (B, H, n, m): the weights' cotangent and the scores' are
    formed keys-major too, so dv and dk are plain products and dq contracts a transposed operand."""
    q, k, v, weights_t = residuals
    f32 = jnp.float32
    g, weights_t = g.astype(f32), weights_t.astype(f32)
    scale = 1.0 / jnp.sqrt(f32(q.shape[-1]))
    d_weights_t = jnp.einsum("bhnd,bhmd->bhnm", v.astype(f32), g)
    if row_sums is None:
        row_sums_t = jnp.sum(d_weights_t * weights_t, axis=-2, keepdims=True)
    else:
        row_sums_t = jnp.swapaxes(row_sums, -1, -2)                                     # (B, H, 1, m)
    d_score_t = weights_t * (d_weights_t - row_sums_t) * scale
    dq = jnp.einsum("bhnm,bhnd->bhmd", d_score_t, k.astype(f32))
    dv = jnp.einsum("bhnm,bhmd->bhnd", weights_t, g)
    dk = jnp.einsum("bhnm,bhmd->bhnd", d_score_t, q.astype(f32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, mask, plan):
    return _attention_fwd(q, k, v, mask, plan)[0]


_attention.defvjp(_attention_fwd, _attention_bwd)


def _attention_given_scores_fwd(q, k, v, score, mask, plan):
    out, weights = plain.weighted_values(score, v, mask)
    return out, ((q, k, v, weights), score)


def _attention_given_scores_bwd(plan, residuals, g):
    attention_residuals, score = residuals
    dq, dk, dv, _ = _attention_bwd(plan, attention_residuals, g)
    return dq, dk, dv, jnp.zeros_like(score), None


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention_given_scores(q, k, v, score, mask, plan):
    return _attention_given_scores_fwd(q, k, v, score, mask, plan)[0]


_attention_given_scores.defvjp(_attention_given_scores_fwd, _attention_given_scores_bwd)
