"""mvmoe-jax: multi-task neural vehicle routing with mixture-of-experts, in JAX/Flax."""

import importlib

__version__ = "0.1.0"
__all__ = ["env", "instances", "io", "problems"]


def __getattr__(name):
    # Submodules load on first use, so that ``mvmoe_jax.host_memory`` can restart the process before JAX
    # is imported; ``mvmoe_jax.env`` etc. work as attributes as they always did.
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
