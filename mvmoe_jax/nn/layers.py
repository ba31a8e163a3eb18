"""Dense layers initialised as PyTorch's ``nn.Linear`` (the paper's training recipe assumes it)."""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


def torch_uniform_init(fan_in: int) -> Callable[..., jax.Array]:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): torch ``nn.Linear`` weight and bias init, and torch's
    ``kaiming_uniform_(a=sqrt(5))`` in general."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class Dense(nn.Module):
    """y = x @ kernel + bias; kernel (in, out), bias (out,), both ~ U(+-1/sqrt(in)) like torch.

    ``dtype`` is the matmul input dtype (accumulation in float32); parameters are ``param_dtype``.
    """

    features: int
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        fan_in = x.shape[-1]
        init = torch_uniform_init(fan_in)
        kernel = self.param("kernel", init, (fan_in, self.features), self.param_dtype)
        y = jnp.matmul(x.astype(self.dtype), kernel.astype(self.dtype), precision=self.precision,
                       preferred_element_type=jnp.float32)
        if self.use_bias:
            y = y + self.param("bias", init, (self.features,), self.param_dtype)
        return y
