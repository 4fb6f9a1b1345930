"""Bounded argument types and the one-line error of the ``atom-sched`` subcommands.

Every numeric flag of ``generate`` and ``simulate`` is parsed by a type built here, so a value
out of its range (or NaN, an infinity, a number too large for the C++ core's int32 fields) is
refused by argparse with one line and exit status 2, before the model loads or anything is
allocated. The limits shared by both subcommands live here too.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

INT32_MAX = 2**31 - 1  # the C++ core's configuration and sampling fields are int32
INT64_MAX = 2**63 - 1

MAX_NUM_SEQS = 65_536  # running requests (batch rows); the core sizes its per-row arrays by it
MAX_BLOCK_SIZE = 1_024  # tokens per KV block
# Block-table entries of one batch: max_num_seqs x blocks per request (max_model_len over
# block_size). The scheduler keeps about 16 bytes per entry (two batches, each with its block
# tables and new-block ids), so this caps its tables at about 1 GiB.
MAX_TABLE_ENTRIES = 2**26
# The scheduling policies both subcommands offer (SchedulerConfig.scheduling, .preemption_victim)
# and the bounds of SJF's aging rate (job tokens credited per second waited).
SCHEDULINGS = ("fcfs", "priority", "sjf", "fair")
VICTIMS = ("service_order", "least_computed")
MIN_SJF_AGING, MAX_SJF_AGING = 1e-6, 1e9


def sjf_aging_rate() -> Callable[[str], float]:
    """The argparse type of --sjf-aging-rate."""
    return finite_float(MIN_SJF_AGING, MAX_SJF_AGING,
                        what=f"a number in [{MIN_SJF_AGING:g}, {MAX_SJF_AGING:g}]")


def _plain(x: float) -> str:
    return f"{x:g}"


def bounded_int(lo: int, hi: int, *, also: Iterable[int] = ()) -> Callable[[str], int]:
    """An argparse type: an integer in lo..hi (or one of `also`)."""
    extra = tuple(also)
    what = " or ".join([*map(str, extra), f"{lo}..{hi}"]) if extra else f"{lo}..{hi}"

    def parse(s: str) -> int:
        try:
            v = int(s.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in {what}, got {s!r}") from None
        if v in extra:
            return v
        if v < lo:
            raise argparse.ArgumentTypeError(
                f"must be >= {lo}, got {v}" if not extra else f"must be {what}, got {v}")
        if v > hi:
            raise argparse.ArgumentTypeError(
                f"must be <= {hi}, got {v}" if not extra else f"must be {what}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def finite_float(lo: float, hi: float, *, lo_open: bool = False, also: Iterable[float] = (),
                 what: str | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number in [lo, hi] ((lo, hi] with `lo_open`) or one of
    `also`; NaN and infinities are refused. `what` replaces the range in the message."""
    extra = tuple(also)
    rng = f"{'(' if lo_open else '['}{_plain(lo)}, {_plain(hi)}]"
    desc = what or " or ".join([*map(_plain, extra), "in " + rng])

    def parse(s: str) -> float:
        try:
            v = float(s.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {desc}, got {s!r}") from None
        if v in extra:
            return v
        if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"must be {desc}, got {s.strip()}")
        return v

    parse.__name__ = "float"
    return parse


def choice_list(choices: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated list of `choices` (each kept once, in the order
    given)."""
    allowed = tuple(choices)

    def parse(s: str) -> tuple[str, ...]:
        items = [x.strip() for x in s.split(",")]
        if any(x not in allowed for x in items):
            raise argparse.ArgumentTypeError(
                f"must be one or more of {', '.join(allowed)}, separated by commas, got {s!r}")
        return tuple(dict.fromkeys(items))

    return parse


def int_list(lo: int, hi: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated integers in lo..hi (each kept once, in the order
    given)."""
    one = bounded_int(lo, hi)

    def parse(s: str) -> tuple[int, ...]:
        return tuple(dict.fromkeys(one(x) for x in s.split(",")))

    return parse


def number_list(lo: float, hi: float, *, max_items: int) -> Callable[[str], tuple[float, ...]]:
    """An argparse type: 1..max_items comma-separated finite numbers in (lo, hi]."""
    one = finite_float(lo, hi, lo_open=True)

    def parse(s: str) -> tuple[float, ...]:
        items = s.split(",")
        if len(items) > max_items:
            raise argparse.ArgumentTypeError(f"must have at most {max_items} numbers, got "
                                             f"{len(items)}")
        return tuple(one(x) for x in items)

    return parse


def text(max_chars: int) -> Callable[[str], str]:
    """An argparse type: a non-empty string of at most `max_chars` characters, valid UTF-8."""

    def parse(s: str) -> str:
        if not s:
            raise argparse.ArgumentTypeError("must not be empty")
        if len(s) > max_chars:
            raise argparse.ArgumentTypeError(f"must be at most {max_chars} characters, "
                                             f"got {len(s)}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise argparse.ArgumentTypeError(
                "is not valid UTF-8 (check the terminal's encoding)") from None
        return s

    parse.__name__ = "text"
    return parse


def output_dir(s: str) -> Path:
    """An argparse type: a folder path that is not an existing file (writable_dir() checks,
    just before the work, that files can be made in it)."""
    if not s.strip():
        raise argparse.ArgumentTypeError("must be a folder path, got ''")
    p = Path(s)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{s} is a file, not a folder")
    return p


def writable_dir(flag: str, path: Path) -> str | None:
    """Why files cannot be written in `path` (made if missing), or None."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{flag} {path}: {e.strerror or e}"
    return None


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_threads() -> int:
    """The most threads a flag accepts: 4 per usable core (more only oversubscribes)."""
    return 4 * usable_cpus()


def table_problem(max_num_seqs: int, max_model_len: int, block_size: int,
                  num_speculative_tokens: int = 0, *, seqs_flag: str = "--max-num-seqs",
                  len_flag: str = "--max-model-len", block_flag: str = "--block-size"
                  ) -> str | None:
    """The scheduler's block tables (one row of max_blocks_per_request() per running request)
    over MAX_TABLE_ENTRIES, as a one-line message; None when they fit."""
    per_request = -(-(max_model_len + 2 * (num_speculative_tokens + 1)) // block_size)
    entries = max_num_seqs * per_request
    if entries <= MAX_TABLE_ENTRIES:
        return None
    return (f"{seqs_flag} {max_num_seqs} x {per_request} blocks per request ({len_flag} "
            f"{max_model_len} / {block_flag} {block_size}) = {entries:,} block-table entries, "
            f"more than {MAX_TABLE_ENTRIES:,} (about 1 GiB of scheduler tables): lower "
            f"{seqs_flag} or {len_flag}, or raise {block_flag}")


def fail(prog: str, message: str) -> int:
    """Prints `prog: error: message` on stderr; returns exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


_ARGUMENT_ERROR = re.compile(r"argument ([^:]+): (.*)", re.S)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose bad values are one line, `prog: error: --flag must be ...`,
    without the usage (which runs to many lines); other errors (an unknown flag, a missing
    argument) print the usage as argparse does. Exit status 2 either way."""

    def error(self, message: str) -> NoReturn:
        m = _ARGUMENT_ERROR.fullmatch(message)
        if m is None:
            super().error(message)
        flag, rest = m.group(1).split("/")[-1], m.group(2)
        line = f"{flag} {rest}" if rest.startswith(("must ", "is ")) else f"{flag}: {rest}"
        self.exit(2, f"{self.prog}: error: {' '.join(line.split())}\n")
