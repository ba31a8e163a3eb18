"""Attention and normalisation blocks shared by the encoder and decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    """(..., n, H*d) -> (..., H, n, d)."""
    *lead, n, hd = x.shape
    return jnp.swapaxes(x.reshape(*lead, n, num_heads, hd // num_heads), -3, -2)


def merge_heads(x: jax.Array) -> jax.Array:
    """(..., H, n, d) -> (..., n, H*d)."""
    x = jnp.swapaxes(x, -3, -2)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def multi_head_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Scaled dot-product attention.

    q (B, H, m, d), k and v (B, H, n, d); mask bool (B, m, n), True = may attend. Returns (B, m, H*d).
    """
    score = jnp.einsum("bhmd,bhnd->bhmn", q, k) / jnp.sqrt(jnp.float32(q.shape[-1])).astype(q.dtype)
    if mask is not None:
        score = jnp.where(mask[:, None], score, -jnp.inf)
    weights = jax.nn.softmax(score.astype(jnp.float32), axis=-1).astype(v.dtype)
    return merge_heads(jnp.einsum("bhmn,bhnd->bhmd", weights, v))


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
