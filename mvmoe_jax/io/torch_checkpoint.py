"""Read PyTorch ``.pt`` checkpoints into numpy arrays without importing torch.

Since torch 1.6, ``torch.save`` writes a zip archive with a single top-level folder::

    <archive>/data.pkl          pickle (protocol 2) of the saved object; storages are persistent ids
    <archive>/data/<key>        raw bytes of one storage (a flat array of one dtype)
    <archive>/byteorder         "little" or "big" (absent before torch 1.12, whose writers were little)
    <archive>/version, ...      bookkeeping this reader does not need

Inside ``data.pkl`` a tensor is ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)``
where ``storage`` is the persistent id ``('storage', torch.XStorage, key, location, numel)``. This module
replays exactly that with numpy: the storage becomes a flat array read from ``data/<key>``, and the
tensor a copy of the strided view into it (offset and strides are in elements, as in torch).

A pickle can call any importable function, so loading a checkpoint with plain ``pickle`` (or
``torch.load(weights_only=False)``) runs whatever the file asks for. Here the unpickler resolves only a
short allow-list of globals, each to a harmless local replacement, and refuses every other one by name.
"""

from __future__ import annotations

import collections
import os
import pickle
import zipfile
import zlib
from typing import Any

import numpy as np

from mvmoe_jax.io.npz_sizes import member_size_error
from mvmoe_jax.io.safe_pickle import UnsafePickleError

__all__ = ["load_torch_checkpoint", "CheckpointFormatError", "UnsafeCheckpointError"]


class UnsafeCheckpointError(UnsafePickleError):
    """``data.pkl`` references a global that a checkpoint has no business calling."""


class CheckpointFormatError(ValueError):
    """The file is not a readable zip-format torch checkpoint (or is damaged)."""


# Storage classes as data.pkl names them -> numpy dtype (the file's byte order is applied later).
# torch.save records the legacy typed names (torch.FloatStorage, ...) for the storage of every tensor;
# torch.storage.UntypedStorage appears only for a bare untyped storage, which torch reads as bytes.
_STORAGE_DTYPES = {
    "DoubleStorage": "f8", "FloatStorage": "f4", "HalfStorage": "f2", "BFloat16Storage": "bfloat16",
    "LongStorage": "i8", "IntStorage": "i4", "ShortStorage": "i2", "CharStorage": "i1",
    "ByteStorage": "u1", "BoolStorage": "?", "ComplexFloatStorage": "c8", "ComplexDoubleStorage": "c16",
    "UntypedStorage": "u1",
}

# Builtins a protocol-2 pickle constructs by name (list, dict, tuple have opcodes of their own).
_BUILTINS = {"set": set, "frozenset": frozenset, "complex": complex, "slice": slice}


def _storage_dtype(name: str) -> np.dtype:
    code = _STORAGE_DTYPES[name]
    if code == "bfloat16":
        try:  # numpy has no bfloat16; ml_dtypes (a jax dependency) provides it
            import ml_dtypes
        except ImportError:  # pragma: no cover - ml_dtypes ships with jax
            raise CheckpointFormatError("a bfloat16 storage needs the ml_dtypes package") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(code)


def _check_ints(what: str, values: Any) -> tuple[int, ...]:
    """Sizes and strides must be tuples of non-negative ints (torch has no negative strides)."""
    if not isinstance(values, tuple) or not all(type(v) is int and v >= 0 for v in values):
        raise CheckpointFormatError(f"tensor {what} must be a tuple of non-negative ints, got {values!r}")
    return values


def _strided_copy(flat: np.ndarray, key: str, offset: Any, size: Any, stride: Any) -> np.ndarray:
    """Copy the view ``flat[offset + sum_k i_k * stride_k]`` into a fresh C-contiguous array."""
    size, stride = _check_ints("size", size), _check_ints("stride", stride)
    if len(size) != len(stride):
        raise CheckpointFormatError(f"tensor size {size} and stride {stride} have different ranks")
    if type(offset) is not int or offset < 0:
        raise CheckpointFormatError(f"tensor storage offset must be a non-negative int, got {offset!r}")
    if 0 in size:
        return np.empty(size, dtype=flat.dtype)
    # The highest element the view touches; checking it keeps as_strided from reading out of bounds.
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= flat.size:
        raise CheckpointFormatError(
            f"storage {key!r} holds {flat.size} elements, too small for a view of size {size}, "
            f"stride {stride} at offset {offset} (needs {last + 1})")
    view = np.lib.stride_tricks.as_strided(
        flat[offset:], shape=size, strides=tuple(s * flat.itemsize for s in stride), writeable=False)
    # A copy, so tensors that shared a storage in torch do not alias each other here.
    return np.array(view, order="C")


class _CheckpointUnpickler(pickle.Unpickler):
    """Unpickles ``data.pkl`` with storages read from the zip and tensors rebuilt as numpy arrays."""

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, byteorder: str, archive_bytes: int):
        super().__init__(file)
        self._archive, self._prefix, self._byteorder = archive, prefix, byteorder
        self._archive_bytes = archive_bytes  # the file's size: no member can hold more
        self._storages: dict[str, np.ndarray] = {}  # key -> flat array; several tensors may share one
        self._storage_keys: dict[int, str] = {}  # id(flat array) -> key, to recognise our own storages

    def find_class(self, module: str, name: str) -> Any:
        # Everything returned is a bound method, a builtin type or an immutable np.dtype, never a
        # module-level mutable object, so not even a BUILD opcode can change state beyond this load.
        if (module, name) in {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")}:
            return self._rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return self._rebuild_parameter
        if module in ("torch", "torch.cuda", "torch.storage") and name in _STORAGE_DTYPES:
            return _storage_dtype(name)  # a storage type is only ever needed for its dtype
        if (module, name) == ("torch", "Size"):
            return tuple
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module in ("builtins", "__builtin__") and name in _BUILTINS:  # protocol 2 writes __builtin__
            return _BUILTINS[name]
        if (module, name) == ("_codecs", "encode"):  # how protocol 2 spells a bytes object
            return self._latin1_bytes
        raise UnsafeCheckpointError(
            f"refusing to load global {module}.{name}: a checkpoint of tensors and plain containers never "
            "needs it (the file is hostile, or it pickles custom objects; save a state_dict instead)")

    def persistent_load(self, pid: Any) -> np.ndarray:
        """Resolve ``('storage', dtype, key, location, numel)`` to the flat array of ``data/<key>``."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointFormatError(f"unsupported persistent id {pid!r} (expected a storage record)")
        _, dtype, key, _location, numel = pid  # location (cpu / cuda:0) is irrelevant for numpy
        if not isinstance(dtype, np.dtype) or not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise CheckpointFormatError(f"malformed storage record {pid!r}")
        if key not in self._storages:
            flat = self._read_storage(key, dtype, numel)
            self._storages[key], self._storage_keys[id(flat)] = flat, key
        return self._storages[key]

    def _read_storage(self, key: str, dtype: np.dtype, numel: int) -> np.ndarray:
        member = f"{self._prefix}data/{key}"
        try:
            info = self._archive.getinfo(member)
        except KeyError:
            raise CheckpointFormatError(
                f"storage {key!r} is referenced but {member} is not in the archive") from None
        nbytes = numel * dtype.itemsize
        if info.file_size < nbytes:
            raise CheckpointFormatError(
                f"storage {key!r} should hold {numel} x {dtype} = {nbytes} bytes, "
                f"but {member} has {info.file_size}")
        # The zip entry's sizes are checked too: a forged one would make us allocate what the file never held.
        problem = member_size_error(info, self._archive_bytes)
        if problem:
            raise CheckpointFormatError(f"storage {key!r}: {member} {problem}")
        flat = np.empty(numel, dtype=dtype.newbyteorder("<" if self._byteorder == "little" else ">"))
        with self._archive.open(info) as f:  # read only the bytes the record claims
            got = f.readinto(flat.view(np.uint8))
        if got != nbytes:
            raise CheckpointFormatError(f"storage {key!r}: {member} ends after {got} of its {nbytes} bytes (truncated)")
        return flat if flat.dtype.isnative else flat.astype(dtype.newbyteorder("="))

    def _rebuild_tensor(self, storage, offset, size, stride, requires_grad=False, backward_hooks=None,
                        metadata=None) -> np.ndarray:
        # requires_grad, hooks and metadata describe autograd state, which has no numpy counterpart.
        key = self._storage_keys.get(id(storage))
        if key is None or self._storages[key] is not storage:
            raise CheckpointFormatError(
                f"tensor storage must come from the archive, got {type(storage).__name__}")
        return _strided_copy(storage, key, offset, size, stride)

    def _rebuild_parameter(self, data, requires_grad=True, backward_hooks=None) -> np.ndarray:
        if not isinstance(data, np.ndarray):
            raise CheckpointFormatError(f"parameter data must be a tensor, got {type(data).__name__}")
        return data  # an nn.Parameter is its tensor plus requires_grad

    def _latin1_bytes(self, text: Any, encoding: Any = "latin1") -> bytes:
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise CheckpointFormatError("_codecs.encode is only accepted as the latin1 spelling of bytes")
        return text.encode("latin1")


def load_torch_checkpoint(path: str | os.PathLike) -> Any:
    """Load a zip-format ``torch.save`` file (usually a dict); every tensor comes back as numpy.

    The saved structure is returned as pickled (dicts, ``OrderedDict`` state dicts, lists, ints, strings
    ...), with each tensor or ``nn.Parameter`` replaced by a C-contiguous numpy array of the same dtype
    and shape, in native byte order, owning its memory (bfloat16 uses ``ml_dtypes.bfloat16``). A bare
    saved storage becomes its flat array. Nothing in the file can run code: only tensor-rebuilding and
    plain-container globals are resolved.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UnsafeCheckpointError: the pickle references any other global (named in the message).
        CheckpointFormatError: empty, truncated, not a zip (e.g. the legacy pre-1.6 format), no ``data.pkl``, a
            missing or short storage, a zip entry stating sizes the file cannot hold, a tensor view that does
            not fit its storage, or otherwise damaged.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such checkpoint file: {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        raise CheckpointFormatError(f"{path}: empty file, not a torch checkpoint")
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):
        raise CheckpointFormatError(f"{path}: a truncated or damaged zip archive (its central directory is "
                                    "missing or unreadable)")
    if not zipfile.is_zipfile(path):
        raise CheckpointFormatError(
            f"{path} is not a zip archive. Only the zip format written by torch.save since torch 1.6 is "
            "supported, not the legacy format (older torch, or _use_new_zipfile_serialization=False). "
            "Convert it once with torch: torch.save(torch.load(old, map_location='cpu'), new)")
    try:
        with zipfile.ZipFile(path) as archive:
            return _load_archive(archive, path)
    except (zipfile.BadZipFile, zlib.error) as e:
        raise CheckpointFormatError(f"{path}: damaged zip archive ({type(e).__name__}: {e})") from None


def _find_prefix(archive: zipfile.ZipFile, path: str) -> str:
    """Return the archive's folder (``"<name>/"``), located through its single top-level data.pkl."""
    found = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(found) != 1:
        raise CheckpointFormatError(
            f"{path}: a torch checkpoint holds exactly one <archive>/data.pkl, found {found or 'none'}")
    return found[0][: -len("data.pkl")]


def _load_archive(archive: zipfile.ZipFile, path: str) -> Any:
    """Unpickle the archive's data.pkl, resolving storages from the same archive."""
    prefix = _find_prefix(archive, path)
    try:
        byteorder = archive.read(prefix + "byteorder").decode("ascii", "replace").strip()
    except KeyError:
        byteorder = "little"  # no byteorder record: written before torch 1.12, by little-endian writers
    if byteorder not in ("little", "big"):
        raise CheckpointFormatError(f"{path}: unknown byteorder {byteorder!r}")
    with archive.open(prefix + "data.pkl") as pkl:
        try:
            return _CheckpointUnpickler(pkl, archive, prefix, byteorder, os.path.getsize(path)).load()
        except (UnsafeCheckpointError, CheckpointFormatError) as e:
            raise type(e)(f"{path}: {e}") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
                KeyError, MemoryError, RecursionError) as e:
            raise CheckpointFormatError(f"{path}: damaged data.pkl ({type(e).__name__}: {e})") from None
