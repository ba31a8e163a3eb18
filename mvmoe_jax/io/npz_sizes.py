"""Size checks of an ``.npz`` archive before numpy reads it.

numpy allocates an array of the shape an ``.npy`` header states before it reads the data, so a small file
that claims a huge shape would ask for terabytes (or, with memory overcommit, fail only later). This reads
every member's header (``numpy.lib.format``) and refuses a member whose stated shape needs more bytes than
the member holds, or whose uncompressed size is over a limit, before any array is allocated.
"""

from __future__ import annotations

import math
import os
import zipfile

import numpy as np

DEFAULT_MAX_BYTES = 8 << 30      # no file this project reads or writes comes near 8 GiB
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def check_npz_sizes(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """A ValueError naming ``path`` and the member when an array's stated shape needs more bytes than the
    member holds, or a member is over ``max_bytes`` uncompressed. Archives numpy cannot read at all are left
    to numpy's own errors."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile):
        return
    with archive:
        for info in archive.infolist():
            if info.file_size > max_bytes:
                raise ValueError(f"{path}: member {info.filename} is {info.file_size} bytes uncompressed, over "
                                 f"the limit of {max_bytes}")
            if not info.filename.endswith(".npy"):
                continue
            with archive.open(info) as member:
                try:
                    version = np.lib.format.read_magic(member)
                    reader = _HEADER_READERS.get(version)
                    if reader is None:
                        raise ValueError(f"unsupported .npy format version {version}")
                    shape, _, dtype = reader(member)
                except (ValueError, EOFError, OSError) as e:
                    raise ValueError(f"{path}: member {info.filename} has no readable array header ({e})") from None
            needed = math.prod(shape) * dtype.itemsize
            if needed > info.file_size:
                raise ValueError(f"{path}: member {info.filename} states shape {shape} of {dtype} ({needed} bytes) "
                                 f"but holds {info.file_size} bytes")
