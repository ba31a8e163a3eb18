"""A restricted unpickler for the paper's data files.

The paper ships its test sets and reference solutions as pickles of plain lists, tuples, floats and numpy
scalars. A bare ``pickle.load`` on a user-supplied path would execute whatever callable the file names,
so this loader admits only the few globals those files need and refuses everything else by name.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

# (module, name) pairs a paper data file may reference: numpy scalars are pickled via these.
_ALLOWED = {
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("builtins", "dict"),
    ("builtins", "float"),
    ("builtins", "int"),
    ("builtins", "complex"),
}


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """The file names a global that a data file has no reason to reference.

    Also a ``ValueError``, what the readers of this package raise for every unusable input, so that callers
    which refuse bad files with ``except ValueError`` refuse this one too instead of crashing."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"refusing to load global {module}.{name}: paper data files contain only lists, tuples, "
            "floats and numpy scalars")


def load(path: str | os.PathLike) -> Any:
    """Load a paper-format pickle through the restricted unpickler, with clear errors."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such data file: {path}")
    with open(path, "rb") as f:
        data = f.read()
    return loads(data, source=path)


def loads(data: bytes, source: str = "<bytes>") -> Any:
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{source}: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, ImportError, MemoryError) as e:
        raise ValueError(f"{source}: not a readable pickle data file ({type(e).__name__}: {e})") from None
