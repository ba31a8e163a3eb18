"""mvmoe-jax: multi-task neural vehicle routing with mixture-of-experts, in JAX/Flax."""

from mvmoe_jax import env, instances, io, problems

__version__ = "0.1.0"
__all__ = ["env", "instances", "io", "problems"]
