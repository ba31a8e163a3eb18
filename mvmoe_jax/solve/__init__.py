"""Solve one's own instances with a trained policy: ``python -m mvmoe_jax.solve`` and its library form.

Modules: ``inputs`` (any input -> problems), ``models`` (which checkpoint), ``search`` (greedy, sampling,
efficient active search and simulation-guided beam search under memory and time limits), ``eas`` (EAS-Emb's
per-instance adaptation), ``sgbs`` (the beam search's depth step),
``outputs`` (``.sol`` files, the JSON summary, the table, adapted embeddings), ``plot`` (PNGs), ``api``
(``solve``, ``solve_instances``).
"""

import importlib

__all__ = ["solve", "solve_instances", "Solution", "SolveReport", "NothingToSolveError", "SEARCHES"]
_FROM = {"solve": "api", "solve_instances": "api", "Solution": "api", "SolveReport": "api",
         "NothingToSolveError": "api", "SEARCHES": "search"}


def __getattr__(name):
    # Loaded on first use, so that ``python -m mvmoe_jax.solve`` can restart the process (host_memory) before
    # JAX is imported.
    if name in _FROM:
        return getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
