"""Errors of the embedding cache, so that callers can tell bad input from a too-small cache."""

from __future__ import annotations


class RecInputError(ValueError):
    """A batch the collection cannot look up (a feature missing, bad dtype, key out of range).

    Raised by validation, before any cache or table state changes, so the caller can drop
    the batch and go on.
    """


class CacheTooSmallError(RuntimeError):
    """The device cache cannot hold the keys of this batch plus the keys protected in flight.

    A RuntimeError, not a ValueError: the batch itself is valid, the configuration (cache
    rows against pipeline depth and batch size) is what must change. Raised before any
    state changes. The numbers are kept as attributes for the caller.
    """

    def __init__(self, table: str, cache_rows: int, keys_requested: int, keys_protected: int,
                 keys_missing: int, slots_available: int, rows_needed: int | None = None) -> None:
        self.table = table
        self.cache_rows = cache_rows
        self.keys_requested = keys_requested
        self.keys_protected = keys_protected
        self.keys_missing = keys_missing
        self.slots_available = slots_available
        #: the least cache_rows that holds this batch's keys and the protected ones together
        #: (a key in both counts once); without the overlap known, their sum
        self.rows_needed = keys_requested + keys_protected if rows_needed is None else rows_needed
        fewer = " or keep fewer batches in flight" if keys_protected else ""
        super().__init__(
            f"embedding cache of table {table!r} is too small: cache_rows={cache_rows}, "
            f"keys requested by this batch={keys_requested} ({keys_missing} not cached), "
            f"keys protected by in-flight batches={keys_protected}, "
            f"slots free or evictable={slots_available}. Raise cache_rows to at least "
            f"{self.rows_needed}{fewer}."
        )


class CacheAbortedError(RuntimeError):
    """A wait inside the cache or host table was woken by `abort(exc)`.

    The original error is the `__cause__`; a pipeline re-raises that one, this only
    guarantees that no thread stays blocked.
    """


class StaleBatchError(RuntimeError):
    """Backward ran for a batch whose cache slots were already released.

    The slots may hold other rows by now, so applying the update would corrupt them.
    """
