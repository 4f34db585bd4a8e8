"""The one type for how linear states are kept: recovery or full states."""

from __future__ import annotations

from enum import Enum


class StateMode(str, Enum):
    """How a deployment keeps its linear (KDA) states during speculative decoding.

    The value is the spelling stored in checkpoint identities and JSON reports;
    :attr:`label` is how tables show it. :meth:`parse` also reads the spellings users
    type (``full``, ``full-state``) so that none of them is retyped elsewhere.
    """

    RECOVERY = "recovery"
    FULL_STATE = "full_state"

    @property
    def label(self) -> str:
        """The name reports and tables print."""
        return "recovery" if self is StateMode.RECOVERY else "full-state"

    @property
    def recovery(self) -> bool:
        """Whether this mode keeps one checkpoint plus update records."""
        return self is StateMode.RECOVERY

    @classmethod
    def of(cls, recovery: bool) -> StateMode:
        """The mode for a recovery on/off flag."""
        return cls.RECOVERY if recovery else cls.FULL_STATE

    @classmethod
    def parse(cls, value: str | StateMode) -> StateMode:
        """``value`` as a mode; raises ``ValueError`` naming the spellings accepted."""
        if isinstance(value, StateMode):
            return value
        spelling = str(value).strip().lower().replace("-", "_")
        if spelling == "full":
            spelling = cls.FULL_STATE.value
        try:
            return cls(spelling)
        except ValueError:
            raise ValueError(
                f"state mode: expected 'recovery' or 'full_state' (or 'full', 'full-state'), "
                f"got {value!r}") from None

    def __str__(self) -> str:
        return self.value


STATE_MODES: tuple[StateMode, ...] = (StateMode.RECOVERY, StateMode.FULL_STATE)
"""Both modes, in the order reports list them."""
