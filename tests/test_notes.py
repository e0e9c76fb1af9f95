"""`torchpipe.notes.add_note`: context on a re-raised error, on Python 3.10 as on 3.11+."""

from __future__ import annotations

from torchpipe.notes import add_note


class WithoutAddNote(Exception):
    """An exception as Python 3.10 makes it: no ``add_note`` method."""

    @property
    def add_note(self):  # type: ignore[override]
        raise AttributeError("add_note")


def test_notes_go_to_the_same_list_with_or_without_add_note() -> None:
    modern, old = ValueError("bad"), WithoutAddNote("bad")
    for error in (modern, old):
        add_note(error, "first")
        add_note(error, "second")
        assert error.__notes__ == ["first", "second"]
        assert str(error) == "bad"  # the message itself is left alone
