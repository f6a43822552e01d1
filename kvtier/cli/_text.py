"""Text helpers shared by the ``kvtier`` subcommands (bench, scrub, doctor, evict), in a
module of their own so that those modules do not import kvtier.cli, which imports them."""
from __future__ import annotations

import errno
import os
import re
import stat
from typing import Optional

EXIT_USAGE = 2
"""The exit status of every subcommand for bad arguments, a ROOT that is no directory among
them (:func:`dir_error`); 0 is done / clean, 1 a check that failed or found something
(``kvtier doctor``: 1 a warning, 2 a failed check too)."""


def dir_error(path: str) -> Optional[str]:
    """Why ``path`` cannot be a subcommand's ROOT (or ``--root``, ``--peer``), as
    ``"<path>: <errno text>"``: stat's own errno (ENOENT, ENOTDIR for a path through a file,
    EACCES, ELOOP), ENOTDIR for something that is not a directory; None for a directory.
    An empty path is shown as ``''`` (not as nothing before the colon).
    Every subcommand that takes a ROOT says this and exits :data:`EXIT_USAGE`."""
    shown = path if path else "''"
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{shown}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{shown}: {os.strerror(errno.ENOTDIR)}"
    return None


def plain_text(doc: str) -> str:
    """A reST docstring as terminal text for --help: ``code`` and
    :role:`target` (``~`` prefix dropped) become plain words; tables and
    indentation stay as they are."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    return re.sub(r"``([^`]+)``", r"\1", doc)


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: float, decimals: int = 1) -> str:
    """``n`` bytes in the largest binary unit that keeps the number >= 1, with ``decimals``
    decimals ("4.0 MiB", "1.5 KiB", "512 B"; ``kvtier bench`` uses 2: "16.00 KiB"), so a
    non-zero size never prints as zero. The one byte formatter of the ``kvtier`` command."""
    if n < 1024:
        return f"{n:.0f} B"
    i = 0
    x = float(n)
    while x >= 1024 and i < len(_UNITS) - 1:
        x /= 1024
        i += 1
    return f"{x:.{decimals}f} {_UNITS[i]}"
