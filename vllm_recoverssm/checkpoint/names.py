"""The names of the checkpoint store's files in a disk directory, parsed without LMCache.

Every object is one file named by LMCache's fs connector after its ``CacheEngineKey``:
``recoverssm-<identity digest[:32]>@<tp size>@<tp rank>@<prefix hash>@uint8@kind%<kind>@
ntok%<n>`` plus ``@bundle%<id>@part%<i>`` for a payload part, then ``.data``. The collector
(:mod:`.gc`) groups parts with the manifest of their prefix by these names alone, so it needs
no layout identity and never touches a name it does not recognise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_GROUP = (
    r"(?P<group>recoverssm-(?:[0-9a-f]{32}|probe)@\d{1,6}@\d{1,6}@[0-9a-f]{1,16}@uint8)"
    r"@kind%(?P<kind>manifest|chunk|probe)@ntok%(?P<ntok>\d{1,12})"
    r"(?:@bundle%(?P<bundle>[0-9a-f]{32})@part%(?P<part>\d{1,9}))?"
)
OBJECT_RE = re.compile(rf"^{_GROUP}\.data$")
"""A stored object."""
LEGACY_TEMP_RE = re.compile(rf"^{_GROUP}\.tmp$")
"""LMCache's own fs connector's temporary name (``<final stem>.tmp``), left by older writes."""
MARKER_RE = re.compile(r"^recoverssm-writing-(?P<bundle>[0-9a-f]{32})\.lock$")
"""A bundle write in flight (:mod:`.inflight`)."""


@dataclass(frozen=True)
class ObjectName:
    """One parsed object file name."""

    group: str
    kind: str
    num_tokens: int
    bundle_id: str | None
    part: int | None

    @property
    def prefix_key(self) -> tuple[str, int]:
        """What a part shares with the manifest of its prefix."""
        return self.group, self.num_tokens

    def manifest_name(self) -> str:
        """The file name of the manifest this object's prefix is published under."""
        return f"{self.group}@kind%manifest@ntok%{self.num_tokens}.data"


def parse_object_name(name: str) -> ObjectName | None:
    """The parsed name of a stored object, or None if ``name`` is not one."""
    m = OBJECT_RE.match(name)
    if m is None:
        return None
    kind = m["kind"]
    has_part = m["bundle"] is not None
    if (kind == "chunk") != has_part:
        return None
    return ObjectName(
        group=m["group"],
        kind=kind,
        num_tokens=int(m["ntok"]),
        bundle_id=m["bundle"],
        part=int(m["part"]) if has_part else None,
    )


def marker_name(bundle_id: str) -> str:
    """The marker file a writer holds while it writes bundle ``bundle_id``."""
    if not re.fullmatch(r"[0-9a-f]{32}", bundle_id):
        raise ValueError(f"bundle id {bundle_id!r}: expected 32 hex digits")
    return f"recoverssm-writing-{bundle_id}.lock"
