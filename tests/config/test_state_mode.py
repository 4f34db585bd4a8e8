"""One type for the state mode, whatever spelling a user or a file uses."""

from __future__ import annotations

import json

import pytest

from vllm_recoverssm.config import STATE_MODES, StateMode


@pytest.mark.parametrize("spelling, mode", [
    ("recovery", StateMode.RECOVERY), ("RECOVERY", StateMode.RECOVERY),
    ("full_state", StateMode.FULL_STATE), ("full-state", StateMode.FULL_STATE),
    ("full", StateMode.FULL_STATE), (StateMode.FULL_STATE, StateMode.FULL_STATE),
])
def test_every_spelling_parses_to_one_mode(spelling: str, mode: StateMode) -> None:
    assert StateMode.parse(spelling) is mode


def test_a_bad_spelling_names_the_ones_accepted() -> None:
    with pytest.raises(ValueError, match="expected 'recovery' or 'full_state'.*'partial'"):
        StateMode.parse("partial")


def test_values_labels_and_flags() -> None:
    assert [m.value for m in STATE_MODES] == ["recovery", "full_state"]
    assert [m.label for m in STATE_MODES] == ["recovery", "full-state"]
    assert StateMode.of(True) is StateMode.RECOVERY and not StateMode.FULL_STATE.recovery
    # a str enum: JSON reports and dict keys keep the stored spelling
    assert json.dumps({StateMode.RECOVERY: 1}) == '{"recovery": 1}'
    assert {"full_state": 2}[StateMode.FULL_STATE] == 2
