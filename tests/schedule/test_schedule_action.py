"""Action: text form, parsing, immutability."""
from __future__ import annotations

import dataclasses

import pytest

from torchpipe.schedule import SCHEDULES, Action, build


def test_str_is_compact_text_form() -> None:
    assert str(Action(2, "F", 0)) == "2F0"
    assert str(Action(12, "B", 103)) == "12B103"
    assert str(Action(0, "I", 7)) == "0I7"
    assert str(Action(3, "W", 11)) == "3W11"


def test_parse_inverts_str_multi_digit() -> None:
    assert Action.parse("2F0") == Action(2, "F", 0)
    assert Action.parse("12B103") == Action(12, "B", 103)
    assert Action.parse("10W1") == Action(10, "W", 1)


@pytest.mark.parametrize("name", SCHEDULES)
def test_round_trip_every_generated_action(name: str) -> None:
    plan = build(name, 4, 12, **({"virtual_stages": 1} if name == "interleaved-1f1b" else {}))
    for act in plan.actions():
        assert Action.parse(str(act)) == act


@pytest.mark.parametrize("text", ["", "F0", "2F", "2X0", "2f0", "-1F0", "2F0x", "2 F 0", "2FB0",
                                  "02F0", "2F00", "\u0662F\u0660"])  # leading zeros, Arabic-Indic digits
def test_parse_rejects_bad_text_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text).replace("\\", "\\\\").replace("(", r"\(")):
        Action.parse(text)


@pytest.mark.parametrize("value", [20, None, b"2F0", ["2F0"]])
def test_parse_rejects_what_is_not_text_with_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match="Action.parse takes the text form"):
        Action.parse(value)  # type: ignore[arg-type]


def test_constructor_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="kind"):
        Action(0, "X", 0)
    with pytest.raises(TypeError, match="kind must be a str"):
        Action(0, ["F"], 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stage"):
        Action(-1, "F", 0)
    with pytest.raises(TypeError, match="microbatch"):
        Action(0, "F", 1.0)  # type: ignore[arg-type]


def test_frozen_and_hashable() -> None:
    act = Action(1, "F", 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        act.stage = 3  # type: ignore[misc]
    assert {act, Action(1, "F", 2)} == {act}
    assert not hasattr(act, "__dict__")  # slots
