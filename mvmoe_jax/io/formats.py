"""Which text format an instance file is in, from its content rather than its name.

A VRPLIB file opens with ``KEY : value`` specification lines (``NAME``, ``TYPE``, ``DIMENSION``, ...) and has
``*_SECTION`` lines; a Solomon file has a ``VEHICLE`` line and, after it, a ``CUSTOMER`` line, each alone on its
line. PyVRP ships VRPLIB files named ``.txt`` (``E-n22-k4.txt``), and Solomon files are found named ``.vrp``, so
the extension only decides when the content says neither (an empty or damaged file).
"""

from __future__ import annotations

import re

VRPLIB, SOLOMON = "VRPLIB", "Solomon"
HEAD_BYTES = 1 << 16            # the part of a file read to recognise it
# Specification keys that open a VRPLIB file (TSPLIB's and CVRPLIB's); one of them, or a section line, marks it.
VRPLIB_KEYS = ("NAME", "TYPE", "COMMENT", "DIMENSION", "CAPACITY", "EDGE_WEIGHT_TYPE", "EDGE_WEIGHT_FORMAT",
               "VEHICLES", "DISTANCE", "SERVICE_TIME")
_VRPLIB_LINE = re.compile(r"^\s*(?:(?:" + "|".join(VRPLIB_KEYS) + r")\s*:|[A-Z_]+_SECTION\b)", re.IGNORECASE)


def text_format(path: str) -> str | None:
    """``VRPLIB`` or ``Solomon`` (``VRPLIB``, ``SOLOMON``) as the first ``HEAD_BYTES`` of the file at ``path`` show, None when they show
    neither (binary, empty or damaged content)."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    if b"\0" in head:
        return None
    lines = [line.strip().upper() for line in head.decode("utf-8", errors="replace").splitlines()]
    if "VEHICLE" in lines and "CUSTOMER" in lines[lines.index("VEHICLE"):]:
        return SOLOMON
    if any(_VRPLIB_LINE.match(line) for line in lines[:50]):
        return VRPLIB
    return None
