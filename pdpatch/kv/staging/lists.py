"""What a staging agent remembers of the descriptor lists its worker prepares: the rows behind
each prepared handle (``get_xfer_descs`` -> ``prep_xfer_dlist``), turned into arrays on first
use, so that a request's ids can be turned back into addresses."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from pdpatch.kv.staging.rows import RowTable

# Lists built and never prepared are forgotten beyond this many (oldest first).
MAX_UNPREPARED = 64


class PreparedLists:
    """Told of every list its agent builds and prepares (:meth:`built`, :meth:`prepared`,
    :meth:`released`); answers with a prepared list's rows (:meth:`entry`, :meth:`table`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[Any, tuple[Any, Any]] = {}      # dlist handle -> (agent, its rows)
        self._arrays: dict[Any, RowTable] = {}           # the same rows as arrays, on first use
        self._unprepped: dict[int, tuple[Any, Any]] = {}  # id(xfer dlist) -> (dlist, rows)

    def built(self, dlist: Any, rows: Any) -> None:
        """``get_xfer_descs(rows)`` returned ``dlist``."""
        with self._lock:
            if len(self._unprepped) > MAX_UNPREPARED:
                self._unprepped.pop(next(iter(self._unprepped)))
            self._unprepped[id(dlist)] = (dlist, rows)

    def prepared(self, handle: Any, agent_name: Any, dlist: Any) -> None:
        """``prep_xfer_dlist(agent_name, dlist)`` returned ``handle``."""
        with self._lock:
            entry = self._unprepped.pop(id(dlist), None)
            rows = entry[1] if entry is not None and entry[0] is dlist else dlist
            if isinstance(rows, (list, tuple, np.ndarray)):
                self._rows[handle] = (agent_name, rows)

    def released(self, handle: Any) -> None:
        with self._lock:
            self._rows.pop(handle, None)
            self._arrays.pop(handle, None)

    def entry(self, handle: Any) -> tuple[Any, Any] | None:
        """``(agent name, rows)`` the list was prepared with; None for a list not seen."""
        with self._lock:
            return self._rows.get(handle)

    def table(self, handle: Any) -> RowTable | None:
        """The list's rows as arrays; None for a list not seen prepared."""
        with self._lock:
            table = self._arrays.get(handle)
            entry = self._rows.get(handle) if table is None else None
        if table is None and entry is not None:
            table = RowTable(entry[1])
            with self._lock:
                self._arrays[handle] = table
        return table


def prep_rows(agent: Any, agent_name: Any, addr: np.ndarray, length: np.ndarray, dev: int,
              mem_type: str) -> Any:
    """A list of its own for one READ (rows ``addr``/``length`` on device ``dev`` of
    ``agent_name``'s memory), prepared; the caller releases it."""
    rows = np.column_stack([addr, length, np.full(addr.size, dev)]).astype(np.uint64)
    return agent.prep_xfer_dlist(agent_name, agent.get_xfer_descs(rows, mem_type))
