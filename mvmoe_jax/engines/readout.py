"""The readout fusion's products (plan fields ``fused_readout`` and ``readout_column_multiple``; reference:
``Policy.decode``'s combining projection then the single-head scores against the node embeddings).

A step's scores are ``(sum_m mix_m (attn @ W_m + b_m)) . emb_n``; folding ``W_m @ emb_n`` into a per-rollout
readout (``Policy.precompute``) turns the per-step (D x D per map, then D x N) work into D x N per map, about
2.8x fewer FLOPs for MVMoE's 4 experts and 3.5x for a dense projection, one instance-batched product instead of
three contractions. The readout's node axis is zero-padded so that every product has a multiple of 16 output
columns, which XLA:CPU runs fastest (docs/performance.md, "Fused readout and query"). The product's backward
pass is written out against a transposed readout; ``readout_product_given`` takes a recorded result
(training's reuse of the sampling pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def padded_readout_nodes(num_nodes: int, map_counts: tuple[int, ...], multiple: int) -> int:
    """The smallest node count >= ``num_nodes`` that makes every product's columns (``m`` maps of it, for
    each ``m`` in ``map_counts``) a multiple of ``multiple``."""
    padded = num_nodes
    while any((m * padded) % multiple for m in map_counts):
        padded += 1
    return padded


@jax.custom_vjp
def readout_product(x: jax.Array, readout: jax.Array) -> jax.Array:
    """``x (B, P, D) @ readout (B, D, X)`` -> (B, P, X) float32, with a backward pass that computes the input's
    cotangent against an explicitly transposed readout (B, X, D). Left to autodiff, XLA:CPU runs that
    product, which contracts the readout's minor axis, slowly (see docs/performance.md, "Stepwise backward")."""
    return jnp.einsum("bpd,bdx->bpx", x, readout, preferred_element_type=jnp.float32)


def _readout_product_fwd(x, readout):
    return readout_product(x, readout), (x, readout)


def _readout_product_bwd(residuals, g):
    x, readout = residuals
    # optimization_barrier keeps XLA from folding the transpose back into the product.
    readout_t = jax.lax.optimization_barrier(jnp.swapaxes(readout, -1, -2))
    dx = jnp.einsum("bpx,bxd->bpd", g.astype(readout.dtype), readout_t, preferred_element_type=jnp.float32)
    dr = jnp.einsum("bpd,bpx->bdx", x, g.astype(x.dtype), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dr.astype(readout.dtype)


readout_product.defvjp(_readout_product_fwd, _readout_product_bwd)


@jax.custom_vjp
def readout_product_given(x: jax.Array, readout: jax.Array, out: jax.Array) -> jax.Array:
    """``readout_product(x, readout)`` whose result ``out`` (B, P, X) is given (recorded when the same product
    ran before); the backward pass is ``readout_product``'s, none for ``out``."""
    return out


def _readout_product_given_fwd(x, readout, out):
    return out, (x, readout)


def _readout_product_given_bwd(residuals, g):
    return _readout_product_bwd(residuals, g) + (None,)


readout_product_given.defvjp(_readout_product_given_fwd, _readout_product_given_bwd)
