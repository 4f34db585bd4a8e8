"""Argument validation shared by every ``recoverssm`` command.

Every option that takes a value is declared with one of the validators below as its argparse
``type`` (or with ``choices``), so every command checks every value the same way and with
bounds: a bad value is one line, ``recoverssm CMD: error: argument --flag: expected ..., got
'...'``, exit code 2, before any work starts. Checks that involve several flags raise
:class:`UsageError` through :func:`flag_error`, which names the flags the user typed.

Bounds are generous for real deployments and small enough that nothing downstream can
allocate without limit, loop without end or wait on a FIFO. A new flag is one
``add_argument(..., type=Int(lo, hi))`` line; the CLI tests find it and fuzz it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

MAX_ARG_CHARS = 4096
"""No value longer than this is parsed (a path or a list; numbers are far shorter)."""
_SHOWN = 160
"""A longer value is shown with its middle cut: the end of a path names the file."""
_SHOWN_HEAD = 48


class UsageError(ValueError):
    """Bad user input: printed as one line, exit code 2 (a ``ValueError``, so that callers
    that report ``ValueError`` as bad input report this one too)."""


def shown(text: str) -> str:
    """``text`` quoted for a message; a huge argument stays one line by losing its middle,
    never its end (the part of a path that names the file)."""
    if len(text) <= _SHOWN:
        return repr(text)
    tail = _SHOWN - _SHOWN_HEAD - 3
    return repr(text[:_SHOWN_HEAD] + "..." + text[-tail:])


def flag_error(flags: str | Iterable[str], message: str) -> UsageError:
    """A :class:`UsageError` naming ``flags`` (e.g. ``"--block-size"``) and what was wrong."""
    names = flags if isinstance(flags, str) else ", ".join(flags)
    return UsageError(f"argument {names}: {message}".replace("\n", " "))


class Validator:
    """An argparse ``type``: parses one value, checks it, says what it expected.

    ``expected`` is the phrase after "expected" in the error; ``samples`` are values at and
    beyond the bounds, for tests that fuzz every flag of every command.
    """

    expected = "a value"

    def __call__(self, text: str) -> object:
        if not isinstance(text, str) or len(text) > MAX_ARG_CHARS or "\0" in text:
            raise self.fail(str(text)[:_SHOWN])
        return self.parse(text)

    def parse(self, text: str) -> object:
        """The checked value of ``text``; ``argparse.ArgumentTypeError`` if it is bad."""
        raise NotImplementedError

    def fail(self, text: str, why: str = "") -> argparse.ArgumentTypeError:
        """The error for ``text``: one line saying what was expected."""
        extra = f" ({why})" if why else ""
        return argparse.ArgumentTypeError(f"expected {self.expected}, got {shown(text)}{extra}")

    def expand(self, text: str) -> Path:
        """``text`` as a path with ``~`` / ``~user`` expanded (a user with no home fails)."""
        try:
            return Path(text).expanduser()
        except RuntimeError:  # pathlib's answer to ~user when that user has no home
            raise self.fail(text, "the home directory of that user is unknown") from None

    def samples(self) -> list[str]:
        """Values near and past the bounds (valid and invalid), for fuzzing."""
        return ["", " ", "x", "nan", "inf", "-inf", "1e309", "9" * 5000, "0x10"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.expected})"


class Int(Validator):
    """An integer in ``lo..hi`` (decimal digits only, no sign games beyond a leading '-')."""

    def __init__(self, lo: int, hi: int) -> None:
        if lo > hi:
            raise ValueError(f"Int({lo}, {hi}): empty range")
        self.lo, self.hi = lo, hi
        self.expected = f"an integer in {lo}..{hi}"

    def parse(self, text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"[-+]?\d{1,30}", t):
            raise self.fail(text)
        value = int(t)
        if not self.lo <= value <= self.hi:
            raise self.fail(text)
        return value

    def samples(self) -> list[str]:
        """Both bounds, one past each, and the usual junk."""
        edge = [self.lo, self.hi, self.lo - 1, self.hi + 1, (self.lo + self.hi) // 2, 2**63]
        return [str(v) for v in edge] + super().samples() + ["1.5", "-0"]


class PowerOfTwo(Int):
    """A power of two in ``lo..hi``."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__(lo, hi)
        self.expected = f"a power of two in {lo}..{hi}"

    def parse(self, text: str) -> int:
        value = super().parse(text)
        if value & (value - 1):
            raise self.fail(text)
        return value

    def samples(self) -> list[str]:
        """The integer samples plus a non-power of two inside the range."""
        return super().samples() + [str(self.lo + 1), str(self.lo * 2)]


class Float(Validator):
    """A finite number in ``lo..hi``; ``lo`` itself excluded when ``lo_open``."""

    def __init__(self, lo: float, hi: float, lo_open: bool = False) -> None:
        self.lo, self.hi, self.lo_open = lo, hi, lo_open
        low = f"> {lo:g}" if lo_open else f">= {lo:g}"
        self.expected = f"a finite number {low} and <= {hi:g}"

    def parse(self, text: str) -> float:
        t = text.strip()
        if not re.fullmatch(r"[-+]?(\d{1,30}(\.\d{0,30})?|\.\d{1,30})([eE][-+]?\d{1,4})?", t):
            raise self.fail(text)
        value = float(t)
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        if not math.isfinite(value) or not low_ok or value > self.hi:
            raise self.fail(text)
        return value

    def samples(self) -> list[str]:
        """Both bounds, values just past them, and non-finite spellings."""
        edge = [self.lo, self.hi, self.hi * 1.5 + 1, self.lo - 1, 1e300]
        return [repr(float(v)) for v in edge] + super().samples() + ["1e-300", "0.5"]


class IntList(Validator):
    """A comma-separated list of at most ``max_items`` integers in ``lo..hi``, sorted, unique."""

    def __init__(self, lo: int, hi: int, max_items: int) -> None:
        self.item = Int(lo, hi)
        self.max_items = max_items
        self.expected = f"at most {max_items} comma-separated integers in {lo}..{hi}"

    def parse(self, text: str) -> tuple[int, ...]:
        items = text.split(",")
        if not 1 <= len(items) <= self.max_items:
            raise self.fail(text)
        try:
            values = [self.item.parse(s) for s in items]
        except argparse.ArgumentTypeError:
            raise self.fail(text) from None
        return tuple(sorted(set(values)))

    def samples(self) -> list[str]:
        """Single bounds, a list too long, and a list with one bad item."""
        lo, hi = self.item.lo, self.item.hi
        too_many = ",".join(str(lo) for _ in range(self.max_items + 1))
        return [str(lo), f"{lo},{hi}", f"{lo},{hi + 1}", too_many, ",", "1,,2"] + super().samples()


class Text(Validator):
    """A short string matching ``pattern`` (a name, never free text)."""

    def __init__(self, max_chars: int, pattern: str, what: str) -> None:
        self.max_chars = max_chars
        self.pattern = re.compile(pattern)
        self.expected = f"{what} of at most {max_chars} characters"

    def parse(self, text: str) -> str:
        if not 1 <= len(text) <= self.max_chars or not self.pattern.fullmatch(text):
            raise self.fail(text)
        return text

    def samples(self) -> list[str]:
        """Too long, path-like and control characters."""
        return ["a" * (self.max_chars + 1), "../x", "a b", "\n"] + super().samples()


class Choice(Validator):
    """One of a fixed set of words (for options validated after parsing; argparse's own
    ``choices`` does the same at parse time)."""

    def __init__(self, values: Iterable[str]) -> None:
        self.values = tuple(values)
        self.expected = f"one of {', '.join(self.values)}"

    def parse(self, text: str) -> str:
        if text not in self.values:
            raise self.fail(text)
        return text

    def samples(self) -> list[str]:
        """Every value, and near misses."""
        return [*self.values, self.values[0].upper(), self.values[0] + "x"] + super().samples()


def check_value(flag: str, validator: Validator, text: str | None) -> object:
    """``validator``'s value of ``text`` (None stays None), or a ``UsageError`` naming
    ``flag``: for options a command validates after argparse (see ``DEFERRED_CHECKS``)."""
    if text is None:
        return None
    try:
        return validator(text)
    except argparse.ArgumentTypeError as exc:
        raise flag_error(flag, str(exc)) from None


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)  # the user's own path: links are fine, the target decides
    except OSError:
        return None


class InputFile(Validator):
    """An existing regular file of at most ``max_bytes`` (or a directory holding
    ``dir_file``); a FIFO or a device is refused before anyone opens it."""

    def __init__(self, max_bytes: int, what: str, dir_file: str | None = None) -> None:
        self.max_bytes = max_bytes
        self.dir_file = dir_file
        holder = f" (or a directory with {dir_file})" if dir_file else ""
        self.expected = f"{what}: a readable file of at most {max_bytes:,} bytes{holder}"

    def parse(self, text: str) -> Path:
        path = self.expand(text)
        st = _lstat(path)
        if st is not None and stat.S_ISDIR(st.st_mode) and self.dir_file:
            path = path / self.dir_file
            st = _lstat(path)
        if st is None:
            raise self.fail(text, "no such file")
        if not stat.S_ISREG(st.st_mode):
            raise self.fail(text, "not a regular file")
        if st.st_size > self.max_bytes:
            raise self.fail(text, f"{st.st_size:,} bytes")
        if not os.access(path, os.R_OK):
            raise self.fail(text, "not readable")
        return path

    def samples(self) -> list[str]:
        """Paths that do not exist or are not files, and a home that cannot be found."""
        return ["/", "/nonexistent/config.json", "/dev/null", "/dev/zero",
                "~nosuchuser0/a"] + super().samples()


class Directory(Validator):
    """A directory: one that exists, or (``create``) one whose parent exists."""

    def __init__(self, what: str, create: bool = False) -> None:
        self.create = create
        self.expected = (f"{what}: a directory, or a new one in an existing directory"
                         if create else f"{what}: an existing directory")

    def parse(self, text: str) -> Path:
        if not text.strip():
            raise self.fail(text)
        path = self.expand(text).absolute()
        st = _lstat(path)
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                raise self.fail(text, "not a directory")
            return path
        parent = _lstat(path.parent)
        if not self.create or parent is None or not stat.S_ISDIR(parent.st_mode):
            raise self.fail(text, "no such directory")
        return path

    def samples(self) -> list[str]:
        """A file, a missing parent, the null device and an unknown user's home."""
        return ["/dev/null", "/nonexistent/a/b", "/etc/hostname",
                "~nosuchuser0"] + super().samples()


class OutputFile(Validator):
    """A file to write: its directory exists and the name is free or a regular file (never a
    FIFO, a device or a directory, which would block or fail the write at the end)."""

    def __init__(self, what: str) -> None:
        self.expected = f"{what}: a file path in an existing directory"

    def parse(self, text: str) -> Path:
        if not text.strip():
            raise self.fail(text)
        path = self.expand(text)
        parent = _lstat(path.parent if str(path.parent) else Path("."))
        if parent is None or not stat.S_ISDIR(parent.st_mode):
            raise self.fail(text, "no such directory")
        st = _lstat(path)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise self.fail(text, "not a regular file")
        return path

    def samples(self) -> list[str]:
        """A directory, the null device, a missing directory and an unknown user's home."""
        return ["/", "/dev/null", "/nonexistent/out.json",
                "~nosuchuser0/out.json"] + super().samples()


def validators_of(parser: argparse.ArgumentParser) -> dict[str, Validator]:
    """Every argument of ``parser`` that has a validator, by its flag (or a positional's
    metavar)."""
    out: dict[str, Validator] = {}
    for action in parser._actions:
        if isinstance(action.type, Validator):
            name = action.option_strings[-1] if action.option_strings else str(action.metavar)
            out[name] = action.type
    return out


def unvalidated_options(
    parser: argparse.ArgumentParser, deferred: Iterable[str] = ()
) -> list[str]:
    """Options that take a value but have no validator, no ``choices`` and no deferred
    check (a test keeps this empty, so a new flag cannot skip validation)."""
    later = set(deferred)
    bad = []
    for action in parser._actions:
        takes_value = action.nargs != 0 and not isinstance(action, argparse._HelpAction)
        if action.option_strings and takes_value and action.choices is None:
            if not isinstance(action.type, Validator) and action.option_strings[-1] not in later:
                bad.append(action.option_strings[-1])
    return bad
