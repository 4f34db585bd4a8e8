"""Bounded clean-up of a disk checkpoint directory: leftovers of interrupted and lost writes.

A process killed mid-write leaves parts that no manifest names; a writer that loses a race on
a prefix, or a bundle replaced by a newer one, leaves more; so do temporary files and stale
write markers. :func:`collect_garbage` removes exactly those, and only once they are older
than a grace period:

* the parts of a bundle are removed only when no live writer holds the bundle's marker
  (:mod:`.inflight`; checked *before* the manifest is read, so a write that finishes in
  between is seen as published), the manifest of their prefix does not name the bundle, and
  the newest of its parts is older than the grace period;
* temporary files (ours and LMCache's ``<name>.tmp``), stale markers and start-up probe
  objects older than the grace period are removed;
* manifests are never removed, not even damaged ones: removing a name could race with a
  writer renaming a new manifest onto it. The next store of that prefix replaces them;
  their parts, which no valid manifest names, are collected like any orphan;
* nothing else is touched: names the store does not write, and anything that is not a regular
  file (links, FIFOs, directories), are counted and left alone.

The scan stops after ``max_files`` directory entries, so a huge directory cannot stall the
caller; the report says so, and a later run goes on.
"""

from __future__ import annotations

import os
import stat
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import DEFAULT_GRACE_S, MAX_FILES_LIMIT, MIN_GRACE_S
from .errors import BundleFormatError, CheckpointConfigError
from .files import TEMP_NAME_RE
from .inflight import write_in_flight
from .lmcache_objects import KEY_MODEL_PREFIX, import_lmcache
from .names import LEGACY_TEMP_RE, MARKER_RE, ObjectName, parse_object_name
from .wire import MAX_MANIFEST_BYTES, manifest_from_bytes

DEFAULT_MAX_FILES = 1_000_000


@dataclass(frozen=True)
class Removed:
    """One file the collector removed (or, in a dry run, would remove)."""

    name: str
    kind: str
    nbytes: int
    reason: str


@dataclass
class GcReport:
    """What one collection saw and did."""

    directory: str
    grace_s: float
    dry_run: bool
    scanned: int = 0
    truncated: bool = False
    removed: list[Removed] = field(default_factory=list)
    referenced_parts: int = 0
    in_flight_parts: int = 0
    young_parts: int = 0
    damaged_manifests: list[str] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def removed_bytes(self) -> int:
        """Bytes of all removed files."""
        return sum(r.nbytes for r in self.removed)

    def summary(self) -> str:
        """One line for a log or a terminal."""
        verb = "would remove" if self.dry_run else "removed"
        kinds: dict[str, int] = defaultdict(int)
        for r in self.removed:
            kinds[r.kind] += 1
        what = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "nothing"
        line = (
            f"{verb} {what} ({self.removed_bytes:,} bytes) after scanning {self.scanned} "
            f"entries; kept {self.referenced_parts} published parts, {self.in_flight_parts} "
            f"parts of writes in flight, {self.young_parts} parts younger than "
            f"{self.grace_s:g} s"
        )
        if self.damaged_manifests:
            line += f"; {len(self.damaged_manifests)} damaged manifests left for a rewrite"
        if self.left_alone:
            line += f"; {len(self.left_alone)} entries that are not regular files left alone"
        if self.errors:
            line += f"; {len(self.errors)} errors"
        if self.truncated:
            line += "; stopped at the scan limit, run again to go on"
        return line

    def to_dict(self) -> dict[str, object]:
        """The report as plain data (for JSON)."""
        out = asdict(self)
        out["removed_bytes"] = self.removed_bytes
        return out


@dataclass
class _Entry:
    name: str
    size: int
    mtime: float


@dataclass
class _Scan:
    parts: dict[tuple[str, int], dict[str, list[_Entry]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    manifests: dict[tuple[str, int], ObjectName] = field(default_factory=dict)
    leftovers: list[tuple[_Entry, str]] = field(default_factory=list)  # temporaries, probes
    markers: list[tuple[_Entry, str]] = field(default_factory=list)


def check_grace(grace_s: float) -> float:
    """``grace_s`` if it is a finite number of seconds >= ``MIN_GRACE_S``."""
    if not (isinstance(grace_s, int | float) and MIN_GRACE_S <= grace_s < float("inf")):
        raise ValueError(f"grace period {grace_s!r}: expected seconds >= {MIN_GRACE_S}")
    return float(grace_s)


def _entries(directory: Path, max_files: int, report: GcReport) -> Iterator[os.DirEntry[str]]:
    with os.scandir(directory) as it:
        for entry in it:
            if report.scanned >= max_files:
                report.truncated = True
                return
            report.scanned += 1
            yield entry


def _scan(directory: Path, max_files: int, report: GcReport) -> _Scan:
    scan = _Scan()
    for entry in _entries(directory, max_files, report):
        name = entry.name
        obj = parse_object_name(name)
        temp = TEMP_NAME_RE.match(name)
        marker = MARKER_RE.match(name)
        ours = (
            obj is not None
            or marker is not None
            or LEGACY_TEMP_RE.match(name) is not None
            or (temp is not None and parse_object_name(temp["final"]) is not None)
        )
        if not ours:
            continue  # not a name the store writes: never touched
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # removed while we looked
        if not stat.S_ISREG(st.st_mode):
            report.left_alone.append(name)
            continue
        e = _Entry(name, st.st_size, st.st_mtime)
        if obj is not None and obj.kind == "chunk":
            assert obj.bundle_id is not None
            scan.parts[obj.prefix_key][obj.bundle_id].append(e)
        elif obj is not None and obj.kind == "manifest":
            scan.manifests[obj.prefix_key] = obj
        elif obj is not None:
            scan.leftovers.append((e, "probe"))
        elif marker is not None:
            scan.markers.append((e, marker["bundle"]))
        else:
            scan.leftovers.append((e, "temporary"))
    return scan


def _published_bundle(directory: Path, name: ObjectName, report: GcReport) -> str | None:
    """The bundle id the manifest of ``name``'s prefix publishes, or None (none, or damaged)."""
    from .fs_connector import read_object

    manifest_name = name.manifest_name()
    raw = read_object(directory / manifest_name, MAX_MANIFEST_BYTES)
    if raw is None:
        if os.path.lexists(directory / manifest_name):
            report.damaged_manifests.append(manifest_name)
        return None
    try:
        manifest = manifest_from_bytes(raw)
    except BundleFormatError:
        report.damaged_manifests.append(manifest_name)
        return None
    # A manifest whose content names another prefix or layout is never restored from this
    # name, so it publishes nothing here.
    ident = manifest.identity
    group = (
        f"{KEY_MODEL_PREFIX}{manifest.identity_digest[:32]}@{ident.tp_size}@{ident.tp_rank}"
        f"@{int(manifest.prefix_digest[:16], 16):x}@uint8"
    )
    if (group, manifest.num_tokens) != name.prefix_key:
        report.damaged_manifests.append(manifest_name)
        return None
    return manifest.bundle_id


def _remove(directory: Path, e: _Entry, kind: str, reason: str, report: GcReport) -> None:
    if not report.dry_run:
        try:
            os.unlink(directory / e.name)
        except FileNotFoundError:
            return  # another collector was first
        except OSError as exc:
            report.errors.append(f"{e.name}: {exc.strerror}")
            return
    report.removed.append(Removed(e.name, kind, e.size, reason))


def collect_garbage(
    directory: Path | str,
    grace_s: float = DEFAULT_GRACE_S,
    max_files: int = DEFAULT_MAX_FILES,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Remove the leftovers of interrupted and lost writes from a disk checkpoint directory.

    See the module docstring for what is removed and what never is. ``now`` (seconds since
    the epoch) is for tests. Raises ``CheckpointConfigError`` if ``directory`` is not a
    directory or LMCache (whose object header the manifests carry) is not installed.
    """
    root = Path(directory)
    grace = check_grace(grace_s)
    if not 1 <= max_files <= MAX_FILES_LIMIT:
        raise ValueError(f"max_files {max_files}: expected 1..{MAX_FILES_LIMIT}")
    if not root.is_dir():
        raise CheckpointConfigError(f"checkpoint directory {root} is not a directory")
    import_lmcache()  # a clear error if LMCache is missing, before anything is read
    cutoff = (time.time() if now is None else now) - grace
    report = GcReport(directory=str(root), grace_s=grace, dry_run=dry_run)
    scan = _scan(root, max_files, report)

    for prefix_key, bundles in scan.parts.items():
        # Markers first, manifest second: a write that finishes in between is published by
        # the time the manifest is read, so its parts are referenced.
        live = {b for b in bundles if write_in_flight(root, b)}
        any_part = next(iter(bundles.values()))[0]
        obj = parse_object_name(any_part.name)
        assert obj is not None
        published = _published_bundle(root, obj, report)
        for bundle_id, entries in bundles.items():
            if bundle_id in live:
                report.in_flight_parts += len(entries)
            elif bundle_id == published:
                report.referenced_parts += len(entries)
            elif max(e.mtime for e in entries) > cutoff:
                report.young_parts += len(entries)
            else:
                why = "damaged manifest" if published is None and prefix_key in scan.manifests \
                    else "no manifest names this bundle"
                for e in entries:
                    _remove(root, e, "part", why, report)
        scan.manifests.pop(prefix_key, None)

    for obj in scan.manifests.values():
        _published_bundle(root, obj, report)  # report damage of manifests without parts

    for e, kind in scan.leftovers:
        if e.mtime <= cutoff:
            _remove(root, e, kind, f"older than {grace:g} s", report)
    for e, bundle_id in scan.markers:
        if e.mtime <= cutoff and not write_in_flight(root, bundle_id):
            _remove(root, e, "marker", "its writer is gone", report)
    return report
