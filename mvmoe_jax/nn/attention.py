"""Multi-head attention and instance normalisation: the encoder's and decoder's building blocks.

The computation is the paper's: scores ``q . k / sqrt(d)`` per head, masked, a softmax over the keys, the
weighted sum of the values, heads concatenated. ``multi_head_attention`` computes it plainly and hands it to
a faster form of ``mvmoe_jax.engines.attention`` where the execution plan asks for one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from mvmoe_jax.engines import attention as engines
from mvmoe_jax.execution import ExecutionPlan


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    """(..., n, H*d) -> (..., H, n, d)."""
    *lead, n, hd = x.shape
    return jnp.swapaxes(x.reshape(*lead, n, num_heads, hd // num_heads), -3, -2)


def merge_heads(x: jax.Array) -> jax.Array:
    """(..., H, n, d) -> (..., n, H*d)."""
    x = jnp.swapaxes(x, -3, -2)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def scaled_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """``q . k / sqrt(d)`` (B, H, m, n) of q (B, H, m, d) and k (B, H, n, d)."""
    # The scale goes on the queries, not the scores: XLA:CPU turns a division of the (B, H, m, n) scores
    # by a scalar into a product with a materialised (B, H, m, n) broadcast.
    scale = (1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))).astype(q.dtype)
    return jnp.einsum("bhmd,bhnd->bhmn", q * scale, k)


def weighted_values(score: jax.Array, v: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(softmax(masked score) @ v (B, H, m, d), the softmax weights (B, H, m, n)); softmax in float32."""
    if mask is not None:
        score = jnp.where(mask[:, None], score, -jnp.inf)
    weights = jax.nn.softmax(score.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhmn,bhnd->bhmd", weights, v), weights


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Scaled dot-product attention per head: q (B, H, m, d), k and v (B, H, n, d), mask bool (B, m, n)
    (True = may attend) -> (B, H, m, d)."""
    return weighted_values(scaled_scores(q, k), v, mask)[0]


def multi_head_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None, *,
                         plan: ExecutionPlan, differentiable: bool = True) -> jax.Array:
    """``attention`` with the heads merged: (B, m, H*d).

    ``plan.attention_vjp``: the form with a written backward pass (``engines.attention.attention``).
    ``differentiable=False`` (static) tells that no gradient is taken and the output is never compared bit for
    bit with the differentiable form's (the encoder outside training mode), which lets
    ``plan.normalise_after_product`` choose the forward-only form.
    """
    if not differentiable and plan.normalise_after_product:
        return engines.attention_normalised_after_product(q, k, v, mask)
    if plan.attention_vjp:
        return merge_heads(engines.attention(q, k, v, mask, plan))
    return merge_heads(attention(q, k, v, mask))


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
