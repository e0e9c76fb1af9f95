"""``collection.embedding_bags``: TorchRec's path to a table's weight, read as a flushed copy.

TorchRec's EBC keeps its tables in an ``embedding_bags`` ModuleDict, and its state_dict keys
(``embedding_bags.<table>.weight``) are that path. Tools walk a key's path by attribute:
``torch.distributed.checkpoint``'s ``get_model_state_dict`` / ``set_model_state_dict`` do,
and so does a user moving from TorchRec (``ebc.embedding_bags["t0"].weight``). A cached
collection's rows live in a host table and a device cache, so there is no module to hand out:
this read-only view answers the same path with a copy of the whole table, flushed first
(the same value ``state_dict()`` saves). Writing goes through ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Callable

import torch

__all__ = ["EmbeddingBagsView", "TableWeight"]


class TableWeight:
    """One table's entry: ``.weight`` is a flushed copy of its embeddings (not a parameter)."""

    def __init__(self, table: str, read: Callable[[str], torch.Tensor]) -> None:
        self._table = table
        self._read = read

    @property
    def weight(self) -> torch.Tensor:
        """A copy of the table's rows, the cache written back first: changing it changes nothing."""
        return self._read(self._table)

    def __repr__(self) -> str:
        return f"TableWeight({self._table!r})"


_MAPPING_CALLS = frozenset({"keys", "items", "values"})


class EmbeddingBagsView(Mapping[str, TableWeight]):
    """Table name -> `TableWeight`, by key (``view["t0"]``) or by attribute (``view.t0``).

    A table's name wins over the view's own attributes (a table called ``get`` or ``_ads``,
    which TorchRec's EBC accepts): a key's path is walked by attribute, so ``view.get`` must
    be that table. ``keys``, ``items`` and ``values`` stay the Mapping's (``dict(view)`` and
    ``==`` call them; TorchRec refuses those table names), and so do double-underscore names
    (``__class__``, copy and pickle probes).
    """

    def __init__(self, tables: list[str], read: Callable[[str], torch.Tensor]) -> None:
        object.__setattr__(self, "_entries", {name: TableWeight(name, read) for name in tables})

    def __getattribute__(self, name: str) -> object:
        if not name.startswith("__") and name not in _MAPPING_CALLS:
            entry = _entries(self).get(name)
            if entry is not None:
                return entry
        return object.__getattribute__(self, name)

    def __getitem__(self, table: str) -> TableWeight:
        entries = _entries(self)
        entry = entries.get(table) if isinstance(table, str) else None
        if entry is None:
            raise KeyError(f"no table named {table!r}; the tables are {list(entries)}")
        return entry

    def __getattr__(self, table: str) -> TableWeight:
        if table.startswith("__"):  # copy/pickle probes
            raise AttributeError(table)
        try:
            return self[table]
        except KeyError as missing:
            raise AttributeError(missing.args[0]) from None

    def __iter__(self) -> Iterator[str]:
        return iter(_entries(self))

    def __len__(self) -> int:
        return len(_entries(self))

    def __repr__(self) -> str:
        return f"EmbeddingBagsView({list(_entries(self))})"


def _entries(view: EmbeddingBagsView) -> dict[str, TableWeight]:
    """The view's tables, read past its own attribute lookup (a table may be called ``_entries``)."""
    return object.__getattribute__(view, "__dict__").get("_entries", {})
