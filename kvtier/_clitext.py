"""Text helpers shared by the ``kvtier`` subcommands (bench, scrub, doctor), in a module of
their own so that those modules do not import kvtier.cli, which imports them."""
from __future__ import annotations

import re


def plain_text(doc: str) -> str:
    """A reST docstring as terminal text for --help: ``code`` and
    :role:`target` (``~`` prefix dropped) become plain words; tables and
    indentation stay as they are."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    return re.sub(r"``([^`]+)``", r"\1", doc)
