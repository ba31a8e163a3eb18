"""Dense layers initialised as PyTorch's ``nn.Linear`` (the paper's training recipe assumes it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

# U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the kernel, as torch's kaiming_uniform_(a=sqrt(5)) gives.
torch_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


class Dense(nn.Module):
    """y = x @ kernel + bias, kernel (in, out). Bias ~ U(-1/sqrt(in), 1/sqrt(in)) like torch."""

    features: int
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32     # computation dtype; parameters stay float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        fan_in = x.shape[-1]
        kernel = self.param("kernel", torch_kernel_init, (fan_in, self.features), jnp.float32)
        y = jnp.matmul(x.astype(self.dtype), kernel.astype(self.dtype),
                       preferred_element_type=jnp.float32)
        if self.use_bias:
            bound = 1.0 / jnp.sqrt(fan_in)
            bias = self.param("bias", lambda k, s: jax.random.uniform(k, s, jnp.float32, -bound, bound),
                              (self.features,))
            y = y + bias
        return y
