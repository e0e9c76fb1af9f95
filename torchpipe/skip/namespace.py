"""Namespaces keep the skip names of repeated blocks apart.

A U-Net built from one block class five times stashes ``'skip'`` five times; isolating each
block instance in its own :class:`Namespace` makes the five names distinct.
"""
from __future__ import annotations

import uuid
from typing import Any

__all__ = ["Namespace"]


class Namespace:
    """A unique, hashable scope for skip names (compare by identity of the scope)."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace {str(self.id)[:8]}>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and self.id == other.id

    def __lt__(self, other: Any) -> bool:  # sortable, for stable messages
        if not isinstance(other, Namespace):
            return NotImplemented
        return self.id < other.id


# Skip names of modules that were never isolated live here.
DEFAULT_NAMESPACE = Namespace()
