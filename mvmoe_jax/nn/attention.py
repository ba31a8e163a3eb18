"""Attention and normalisation blocks shared by the encoder and decoder."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import flax.linen as nn

from mvmoe_jax import devices

# How ``_attention_bwd`` writes its two products that contract over the queries (dk, dv): True, against
# explicitly transposed operands; False, as products with a transposed operand, left to XLA; None, by
# where the program runs (``products_against_transposes``). Read at trace time.
PRODUCTS_AGAINST_TRANSPOSES: bool | None = None

# How ``attention_from_scores`` merges its heads: True, by concatenating the heads' slices
# (``merge_heads_by_slices``); False, by a transpose (``merge_heads``); None, by where the program runs
# (``merges_by_slices``). Read at trace time.
MERGE_BY_SLICES: bool | None = None

# Whether the backward pass of ``attention_with_given_weights`` (training's decoding steps) takes the softmax
# backward's row sums from the recorded output (``output_row_sums``) rather than from the weights: no pass over
# the weights, the same gradient up to float32 rounding (see docs/performance.md, "Attention backward
# layouts"). Read at trace time.
ROW_SUMS_FROM_OUTPUT: bool = True

# Layout of the recorded softmax weights (those ``attention_from_scores(..., with_weights=True)`` returns
# and ``attention_with_given_weights`` takes): True, keys-major (B, H, n, m); False, queries-major
# (B, H, m, n); None, by where the program runs (``keys_major_weights``). Read at trace time.
KEYS_MAJOR_WEIGHTS: bool | None = None

# How ``multi_head_attention(..., differentiable=False)`` (the encoder outside training mode) computes its
# output: True, normalised after the value product as ``attention_from_scores`` does; False, the softmax
# first, as the differentiable form does; None, by where the program runs (``normalises_after_product``).
# Read at trace time.
NORMALISE_AFTER_PRODUCT: bool | None = None


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    """(..., n, H*d) -> (..., H, n, d)."""
    *lead, n, hd = x.shape
    return jnp.swapaxes(x.reshape(*lead, n, num_heads, hd // num_heads), -3, -2)


def merge_heads(x: jax.Array) -> jax.Array:
    """(..., H, n, d) -> (..., n, H*d)."""
    x = jnp.swapaxes(x, -3, -2)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def merge_heads_by_slices(x: jax.Array) -> jax.Array:
    """``merge_heads`` written as the concatenation of the H heads' (..., n, d) slices along the last axis:
    the same array, which XLA:CPU builds faster than the transpose for a decoding step's small output
    (see ``merges_by_slices``)."""
    return jnp.concatenate([x[..., h, :, :] for h in range(x.shape[-3])], axis=-1)


def merges_by_slices() -> bool:
    """Whether ``attention_from_scores`` merges its heads with ``merge_heads_by_slices`` rather than
    ``merge_heads`` (``MERGE_BY_SLICES`` overrides): on a CPU, where a decoding step's small (H, P, d) output
    is merged faster so. Only this merge: merging the encoder's heads (``multi_head_attention``) by slices as
    well gained nothing, and the training step was a tie either way (see docs/performance.md, "Head merge by
    slices"). Accelerators keep the transpose."""
    if MERGE_BY_SLICES is not None:
        return MERGE_BY_SLICES
    return jax.default_backend() == "cpu"


def multi_head_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None,
                         differentiable: bool = True) -> jax.Array:
    """Scaled dot-product attention.

    q (B, H, m, d), k and v (B, H, n, d); mask bool (B, m, n), True = may attend. Returns (B, m, H*d).
    ``differentiable`` (static): the form with a hand-written backward pass (see ``_attention_bwd``), whose
    forward pass keeps the softmax weights for it. False: a forward form that ``normalises_after_product``
    may choose (still differentiable by autodiff, only not written for it), for callers that take no
    gradient and never compare their output bit for bit with the differentiable form's (see there).
    """
    if not differentiable and normalises_after_product():
        score = _masked(_scaled_scores(q, k), mask)
        _, total, out = _exponentials(score, jnp.max(score, axis=-1, keepdims=True), v)
        # Merged by the transpose: for the encoder's (B, H, n, d) the slices were slower, unlike for a decoding
        # step's small output (see docs/performance.md, "Normalisation after the value product").
        return merge_heads((out / total).astype(v.dtype))
    return merge_heads(_attention(q, k, v, mask))


def normalises_after_product() -> bool:
    """Whether ``multi_head_attention(..., differentiable=False)`` normalises its softmax after the value
    product, as ``attention_from_scores`` does (``NORMALISE_AFTER_PRODUCT`` overrides): on a CPU. The
    softmax first writes the (B, H, m, n) weights in a pass of their own; normalised after, the exponentials
    feed the product and only the (B, H, m, d) output is divided, which is faster for the encoder's calls of
    many instances and a tie for a few (see docs/performance.md, "Normalisation after the value product").

    Only for the encoder outside training mode, as a plain function beside the custom-vjp one rather than as
    that one's primal. As the primal it would break the replay's gradient: JAX's vmap of a custom-vjp call
    takes the outputs' batch axis from the primal function, traced when the call is staged, and reads the
    forward rule's outputs at that axis when the call is differentiated later. Batched by
    ``jax.lax.map(..., batch_size=8)`` over the replay's steps with the keys closed over, this form's output
    carries the batch on axis 0 and ``_attention_fwd``'s on axis 2; where the shapes agree the values are
    silently scrambled. Every custom-vjp primal here is therefore its forward rule's own output
    (``test_attention_value_is_the_same_under_a_gradient_in_a_batched_map`` guards the case). Training mode
    keeps the differentiable form in every pass as well, so that the sampling pass computes what the backward
    pass recomputes. Accelerators keep the softmax first, the form their figures were measured with.
    """
    if NORMALISE_AFTER_PRODUCT is not None:
        return NORMALISE_AFTER_PRODUCT
    return jax.default_backend() == "cpu"


def attention_from_scores(score: jax.Array, v: jax.Array, mask: jax.Array | None = None,
                          with_weights: bool = False):
    """The rest of ``multi_head_attention`` from its scaled scores (B, H, m, n): (B, m, H*d). Forward only.
    ``with_weights``: also return the softmax weights float32, for a later ``attention_with_given_weights``,
    in the layout records keep (``keys_major_weights``: (B, H, n, m) or (B, H, m, n)).

    The softmax's normalisation is applied after the product with the values, to the (B, H, m, d) output
    instead of to the (B, H, m, n) weights: a division per output element rather than per weight, and a
    product XLA:CPU does not fuse with the division; faster for a CPU decoding step (see docs/performance.md,
    "Normalisation after the value product"), and equal to the softmax first up to float32 rounding.
    """
    score = _masked(score, mask)
    unnormalised, total, out = _exponentials(score, jnp.max(score, axis=-1, keepdims=True), v)
    out = _merged(out / total, v.dtype)
    return (out, kept_layout(unnormalised / total)) if with_weights else out


# ``attention_from_bounded_scores`` keeps the bounded result only if every row's exponentials sum to at least this,
# i.e. if no bound lies more than ~46 above its row's largest score: every term that matters at float32 precision
# is then a normal number, so the result is the softmax's up to rounding.
MIN_BOUNDED_ROW_TOTAL = 1e-20


def attention_from_bounded_scores(scores: Callable[[], jax.Array], v: jax.Array, mask: jax.Array | None,
                                  row_bound: jax.Array) -> jax.Array:
    """``attention_from_scores(scores(), v, mask)`` with each row's exponentials taken against ``row_bound``
    (B, H, m, 1), an upper bound on the row's largest score known beforehand, instead of the row's maximum.
    Forward only.

    The softmax is the same for any offset; the maximum only keeps the exponentials from overflowing, which an
    upper bound does as well. Without the maximum, XLA computes the scores, masks them and takes their
    exponentials in one loop instead of a loop, a reduction and a second pass. Should some row's exponentials
    sum to less than ``MIN_BOUNDED_ROW_TOTAL`` (its bound too loose: its terms may have underflowed), the
    whole call is computed again against the maximum, in a branch that runs only then. ``scores`` (a function
    returning the scaled scores (B, H, m, n)) is called again there, so that the bounded path need not keep
    the scores for it, which would cost their fusion with the exponentials.
    """
    score = _masked(scores(), mask)
    _, total, out = _exponentials(score, row_bound.astype(jnp.float32), v)
    out = _merged(out / total, v.dtype)          # outside the branch: XLA:CPU runs a branch's work less well
    failed = jnp.max((total < MIN_BOUNDED_ROW_TOTAL).astype(jnp.int32))
    # The branch takes the mask negated and negates it back: a feasibility mask arrives as ``~any(rules)``,
    # and XLA folds the double negation, handing the branch the rules' reduction instead of materialising
    # its negation each step (see docs/performance.md, "Score bounds").
    blocked = None if mask is None else ~mask

    def fallback(blocked):
        return attention_from_scores(scores(), v, None if blocked is None else ~blocked)

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


def _merged(out: jax.Array, dtype) -> jax.Array:
    """The normalised (B, H, m, d) output as (B, m, H*d) ``dtype``, merged as ``merges_by_slices`` chooses."""
    out = out.astype(dtype)
    return merge_heads_by_slices(out) if merges_by_slices() else merge_heads(out)


def attention_with_given_scores(q: jax.Array, k: jax.Array, v: jax.Array, score: jax.Array,
                                mask: jax.Array | None = None) -> jax.Array:
    """``multi_head_attention(q, k, v, mask)`` whose forward pass takes the scaled scores ``q . k / sqrt(d)``
    (B, H, m, n) as given (computed more cheaply elsewhere, e.g. gathered from a per-rollout table) instead
    of multiplying q and k again. The backward pass is ``multi_head_attention``'s: cotangents for q, k and v
    as if the scores had been computed from them, none for ``score`` itself (it must not depend on anything
    differentiated except through q and k). Returns (B, m, H*d)."""
    return merge_heads(_attention_given_scores(q, k, v, score, mask))


def attention_with_given_weights(q: jax.Array, k: jax.Array, v: jax.Array, weights: jax.Array,
                                 out: jax.Array) -> jax.Array:
    """``multi_head_attention(q, k, v, mask)`` whose forward pass is given: its softmax weights (in the layout
    of ``keys_major_weights``) and output (B, m, H*d), recorded when the same attention ran before (training's
    sampling pass, see ``attention_from_scores(..., with_weights=True)``). Returns ``out``; the backward pass is
    ``multi_head_attention``'s, cotangents for q, k and v, none for the record (it must equal what q, k
    and v give, and depend on nothing differentiated), with the softmax backward's row sums taken from
    ``out`` (``output_row_sums``, see ``ROW_SUMS_FROM_OUTPUT``)."""
    return _attention_given_weights(q, k, v, weights, out)


@jax.custom_vjp
def _attention_given_weights(q, k, v, weights, out):
    return out


def _attention_given_weights_fwd(q, k, v, weights, out):
    return out, ((q, k, v, weights), out)


def _attention_given_weights_bwd(residuals, g):
    attention_residuals, out = residuals
    num_heads = attention_residuals[0].shape[1]
    row_sums = output_row_sums(g, out, num_heads) if ROW_SUMS_FROM_OUTPUT else None
    backward = _attention_bwd_keys_major if keys_major_weights() else _attention_bwd
    dq, dk, dv, _ = backward(attention_residuals, split_heads(g, num_heads), row_sums)
    return dq, dk, dv, None, None


def output_row_sums(g: jax.Array, out: jax.Array, num_heads: int) -> jax.Array:
    """The softmax backward's row sums ``sum_n dW[..., n] * W[..., n]`` (B, H, m, 1), for an attention whose
    output ``out`` (B, m, H*d) and its cotangent ``g`` are given merged: as ``dW = g_h @ v_h^T`` and
    ``out_h = W @ v_h``, each row's sum equals ``sum_d g_h[..., d] * out_h[..., d]`` (FlashAttention's form):
    a product of two (B, m, H*d) arrays summed over each head's d, instead of a pass over the (B, H, m, n)
    weights."""
    b, m, hd = g.shape
    per_head = jnp.sum((g.astype(jnp.float32) * out.astype(jnp.float32)).reshape(b, m, num_heads, hd // num_heads),
                       axis=-1)
    return jnp.swapaxes(per_head, -1, -2)[..., None]


_attention_given_weights.defvjp(_attention_given_weights_fwd, _attention_given_weights_bwd)


def _weighted_values(score, v, mask):
    """(softmax(masked score) @ v (B, H, m, d), the softmax weights)."""
    if mask is not None:
        score = jnp.where(mask[:, None], score, -jnp.inf)
    weights = jax.nn.softmax(score.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhmn,bhnd->bhmd", weights, v), weights


def keys_major_weights() -> bool:
    """Whether recorded softmax weights (``attention_from_scores(..., with_weights=True)``, training's
    sampling pass) are kept keys-major, (B, H, n, m), rather than queries-major (``KEYS_MAJOR_WEIGHTS``
    overrides). Keys-major, the backward pass of ``attention_with_given_weights`` forms the score cotangent
    keys-major too: the value and key cotangents (``dv = W^T g``, ``dk = dS^T q``, contracting over the
    queries) become plain products, and the query's (``dq = dS k``) the one product with a transposed
    operand. Chosen where such products are left to XLA (``products_against_transposes`` False: AVX-512
    CPUs), which runs them outside its fast matmul library, slower than plain ones (see docs/performance.md,
    "Attention backward layouts").

    Only the record: where the backward pass recomputes the weights inside its own step (the encoder,
    POMO-MTL's and MVMoE-L's decoding steps), keeping them keys-major as well made the training steps
    slower: the transposed copy then costs a pass of its own."""
    if KEYS_MAJOR_WEIGHTS is not None:
        return KEYS_MAJOR_WEIGHTS
    return not products_against_transposes()


def kept_layout(weights: jax.Array) -> jax.Array:
    """Queries-major softmax weights (B, H, m, n) in the layout records keep (``keys_major_weights``), and
    back: the map is its own inverse (a swap of the last two axes, or nothing)."""
    return jnp.swapaxes(weights, -1, -2) if keys_major_weights() else weights


def _scaled_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """``q . k / sqrt(d)`` (B, H, m, n) of q (B, H, m, d) and k (B, H, n, d)."""
    # The scale goes on the queries, not the scores: XLA:CPU turns a division of the (B, H, m, n) scores
    # by a scalar into a product with a materialised (B, H, m, n) broadcast (the encoder's self-attention
    # then read a 200 MB constant per layer at 512 instances of n = 50).
    scale = (1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))).astype(q.dtype)
    return jnp.einsum("bhmd,bhnd->bhmn", q * scale, k)


def _attention_fwd(q, k, v, mask):
    """(B, H, m, d) output and the residuals (q, k, v, softmax weights) of the backward pass."""
    out, weights = _weighted_values(_scaled_scores(q, k), v, mask)
    return out, (q, k, v, weights)


def products_against_transposes() -> bool:
    """Whether ``_attention_bwd`` transposes the softmax weights and the score cotangents explicitly before
    its two products that contract over the queries (dk, dv), rather than leaving XLA products with a
    transposed operand (``PRODUCTS_AGAINST_TRANSPOSES`` overrides). Which is faster depends on the CPU: with
    AVX2 XLA:CPU runs the transposed-operand products outside its fast matmul library, several times slower
    than plain products, so the explicit transposes win; with AVX-512 the transposed-operand products win
    (see docs/performance.md, "Attention backward layouts"). Accelerators keep the explicit transposes, the
    form their figures were measured with."""
    if PRODUCTS_AGAINST_TRANSPOSES is not None:
        return PRODUCTS_AGAINST_TRANSPOSES
    return not (jax.default_backend() == "cpu" and devices.cpu_has_avx512())


def _attention_bwd(residuals, g, row_sums=None):
    """The softmax-attention gradients from the residuals (q, k, v, queries-major softmax weights); the two
    products that contract over the queries (dk, dv) are written as ``products_against_transposes``
    chooses. ``row_sums`` (B, H, m, 1): the softmax backward's ``sum(dW * W)`` when known otherwise
    (``output_row_sums``)."""
    q, k, v, weights = residuals
    f32 = jnp.float32
    g, weights = g.astype(f32), weights.astype(f32)
    scale = 1.0 / jnp.sqrt(f32(q.shape[-1]))
    d_weights = jnp.einsum("bhmd,bhnd->bhmn", g, v.astype(f32))
    if row_sums is None:
        row_sums = jnp.sum(d_weights * weights, axis=-1, keepdims=True)
    d_score = weights * (d_weights - row_sums) * scale
    dq = jnp.einsum("bhmn,bhnd->bhmd", d_score, k.astype(f32))
    if products_against_transposes():
        # optimization_barrier keeps XLA from folding the transposes back into the dots.
        weights_t, d_score_t = jax.lax.optimization_barrier((jnp.swapaxes(weights, -1, -2),
                                                             jnp.swapaxes(d_score, -1, -2)))
        dv = jnp.einsum("bhnm,bhmd->bhnd", weights_t, g)
        dk = jnp.einsum("bhnm,bhmd->bhnd", d_score_t, q.astype(f32))
    else:
        dv = jnp.einsum("bhmn,bhmd->bhnd", weights, g)
        dk = jnp.einsum("bhmn,bhmd->bhnd", d_score, q.astype(f32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def _attention_bwd_keys_major(residuals, g, row_sums=None):
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


@jax.custom_vjp
def _attention(q, k, v, mask):
    return _attention_fwd(q, k, v, mask)[0]


_attention.defvjp(_attention_fwd, _attention_bwd)


def _attention_given_scores_fwd(q, k, v, score, mask):
    out, weights = _weighted_values(score, v, mask)
    return out, ((q, k, v, weights), score)


def _attention_given_scores_bwd(residuals, g):
    attention_residuals, score = residuals
    dq, dk, dv, _ = _attention_bwd(attention_residuals, g)
    return dq, dk, dv, jnp.zeros_like(score), None


@jax.custom_vjp
def _attention_given_scores(q, k, v, score, mask):
    return _attention_given_scores_fwd(q, k, v, score, mask)[0]


_attention_given_scores.defvjp(_attention_given_scores_fwd, _attention_given_scores_bwd)


class InstanceNorm(nn.Module):
    """Instance normalisation over the node axis, per instance and channel (affine, eps 1e-5).

    x (B, n, D) -> (B, n, D). Biased variance, as torch's InstanceNorm1d without running statistics.
    """

    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dim = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (dim,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (dim,), jnp.float32)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-2, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-2, keepdims=True)
        y = (x32 - mean) / jnp.sqrt(var + self.epsilon)
        return (y * scale + bias).astype(x.dtype)
