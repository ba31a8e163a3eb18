"""Reading an ``.npz`` archive of plain arrays safely: sizes checked before numpy allocates, errors naming the file.

numpy allocates an array of the shape an ``.npy`` header states before it reads the data, so a small file
that claims a huge shape would ask for terabytes (or, with memory overcommit, fail only later). This reads
every member's header (``numpy.lib.format``) and refuses a member whose stated shape needs more bytes than
the member holds, whose zip entry states sizes the archive cannot hold, or whose uncompressed size is over a
limit, before any array is allocated. ``read_arrays`` does these checks and then loads without pickles.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib

import numpy as np

DEFAULT_MAX_BYTES = 8 << 30      # no file this project reads or writes comes near 8 GiB
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def member_size_error(info: zipfile.ZipInfo, archive_bytes: int, max_bytes: int = DEFAULT_MAX_BYTES) -> str | None:
    """Why the sizes a zip entry states cannot be true or are too large to read, or None. A reader that trusts a
    forged entry allocates (and may return) memory the file never held."""
    if info.file_size > max_bytes:
        return f"is {info.file_size} bytes uncompressed, over the limit of {max_bytes}"
    if info.compress_size > archive_bytes:
        return f"claims {info.compress_size} stored bytes in an archive of {archive_bytes}"
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        return (f"claims {info.file_size} bytes uncompressed but stores {info.compress_size} without "
                "compression (a damaged or forged zip entry)")
    return None


def check_npz_sizes(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """A ValueError naming ``path`` and the member when an array's stated shape needs more bytes than the
    member holds, or a member's zip entry states impossible sizes or is over ``max_bytes`` uncompressed.
    Archives numpy cannot read at all are left to numpy's own errors."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile):
        return
    archive_bytes = os.path.getsize(path)
    with archive:
        for info in archive.infolist():
            problem = member_size_error(info, archive_bytes, max_bytes)
            if problem:
                raise ValueError(f"{path}: member {info.filename} {problem}")
            if not info.filename.endswith(".npy"):
                continue
            with archive.open(info) as member:
                try:
                    version = np.lib.format.read_magic(member)
                    reader = _HEADER_READERS.get(version)
                    if reader is None:
                        raise ValueError(f"unsupported .npy format version {version}")
                    shape, _, dtype = reader(member)
                except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error) as e:
                    raise ValueError(f"{path}: member {info.filename} has no readable array header ({e})") from None
            needed = math.prod(shape) * dtype.itemsize
            if needed > info.file_size:
                raise ValueError(f"{path}: member {info.filename} states shape {shape} of {dtype} ({needed} bytes) "
                                 f"but holds {info.file_size} bytes")


def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` file at ``path`` by name, read without pickles after ``check_npz_sizes``.
    A ValueError naming the file for anything else: not an archive (truncated, empty, other bytes), a bare
    ``.npy`` array, pickled (object) arrays, a damaged member."""
    check_npz_sizes(path)
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                return {key: loaded[key] for key in loaded.files}
    except (OSError, zipfile.BadZipFile, zlib.error, EOFError, ValueError) as e:
        # numpy raises ValueError for pickled data / object arrays under allow_pickle=False.
        raise ValueError(f"{path}: not a readable .npz file of plain arrays ({type(e).__name__}: {e})") from None
    raise ValueError(f"{path}: a single .npy array, not an .npz archive")
