"""Notes on an exception (PEP 678), the same way on every Python the package supports.

Why: torchpipe adds context to an error it re-raises (which layer was profiled, which
batches were in flight) without changing the error's type or message. ``add_note`` exists
from Python 3.11; on 3.10 the note goes to the same ``__notes__`` list, which pytest and
the ``exceptiongroup`` backport print, though 3.10's own traceback does not.
"""

from __future__ import annotations

__all__ = ["add_note"]


def add_note(error: BaseException, note: str) -> None:
    """Append ``note`` to ``error``'s notes (``error.add_note`` where Python has it)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
        return
    notes = getattr(error, "__notes__", None)
    try:
        error.__notes__ = [*notes, note] if isinstance(notes, list) else [note]  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that refuses new attributes: no note rather than no error
        pass
