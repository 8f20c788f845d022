"""Blocks of Markdown that a command writes and a test checks: what lies between a pair of marker
comments belongs to that command, so a page never carries a hand-typed copy of what the code
(the registry, the raw result files) says.

    <!-- BEGIN generated: NAME (COMMAND) -->
    ...
    <!-- END generated: NAME -->

``lab/doc_tables.py`` (``python -m scripts.doc_tables``) and ``lab/report`` (``python -m
lab.report``) each own the blocks that name their command.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping


def _pattern(name: str, command: str) -> re.Pattern[str]:
    begin = f"<!-- BEGIN generated: {name} ({command}) -->"
    return re.compile(re.escape(begin) + r"\n.*?" + re.escape(f"<!-- END generated: {name} -->"),
                      re.S)


def names(text: str, command: str) -> list[str]:
    """The blocks of ``command`` in ``text``, in order."""
    return re.findall(r"<!-- BEGIN generated: (\S+) \(" + re.escape(command) + r"\) -->", text)


def fill(text: str, command: str, blocks: Mapping[str, Callable[[], str]],
         where: str = "the page") -> str:
    """``text`` with each of ``command``'s blocks in it replaced by what ``blocks`` makes of it;
    a block ``blocks`` does not know is an error (a name mistyped, or a table taken out)."""
    for name in names(text, command):
        if name not in blocks:
            raise SystemExit(f"{where}: no generator for the block {name!r} ({command})")
        body = f"<!-- BEGIN generated: {name} ({command}) -->\n{blocks[name]()}\n" \
               f"<!-- END generated: {name} -->"
        text, found = _pattern(name, command).subn(lambda _, body=body: body, text, count=1)
        if not found:
            raise SystemExit(f"{where}: the block {name!r} has no END marker")
    return text
