"""Matmul precision of the float32 models: full float32 for evaluation, TF32 allowed for training.

JAX computes float32 matmuls on recent NVIDIA GPUs in TF32 (10-bit mantissa inputs) unless told otherwise;
torch, and so the original implementation, computes them in full float32. On a GPU, full float32 gives
the original implementation's objectives (the per-instance parity tests pass); TF32 is faster but moves
them slightly, below the parity tests' bar (see docs/performance.md, "Matmul precision on a GPU").

Hence evaluation runs in full float32 by default (``config.eval_matmul_precision``, ``evaluate.py
--matmul_precision``) and training, whose sampled rollouts need speed more than bit-level agreement, allows
TF32 (``config.matmul_precision``). On a CPU every setting computes in float32.

Library users choose per block: ``with matmul_precision("float32"): evaluation.evaluate_dataset(...)``.
The setting is read when a function is traced, and is part of jit's cache key, so a function traced under
one setting is retraced, not reused, under another.
"""

from __future__ import annotations

import contextlib

import jax

# "default": JAX's own choice for the backend (TF32 on recent NVIDIA GPUs, float32 on a CPU).
MATMUL_PRECISIONS = ("float32", "tensorfloat32", "bfloat16", "default")
EVAL_DEFAULT = "float32"
TRAIN_DEFAULT = "tensorfloat32"


def check(name: str, what: str = "matmul precision") -> str:
    """``name`` when it is one of MATMUL_PRECISIONS, else a ValueError naming ``what`` and listing them."""
    if name not in MATMUL_PRECISIONS:
        raise ValueError(f"{what} must be one of {', '.join(MATMUL_PRECISIONS)}, got {name!r}")
    return name


def matmul_precision(name: str):
    """A context manager under which float32 matmuls (and convolutions) traced inside run at ``name``."""
    if check(name) == "default":
        return contextlib.nullcontext()
    return jax.default_matmul_precision(name)
