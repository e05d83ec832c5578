"""The benchmarks' comma-list options, parsed one way: `--sizes 1M,8M`, `--dtypes fp32,bf16`,
`--batches 1,8`. An empty list, an unknown item or a batch size out of range is one UsageError line
naming the option (exit 2)."""
from __future__ import annotations

from core.errors import UsageError

MAX_BATCH = 256


def comma_list(value: str | None, option: str, known=None, item: str = "item", default=()) -> list[str]:
    """The items of a comma list (`default` when the option was not given), each one of `known` when known
    is given; `item` names one in the message (`--sizes '9T': ... found unknown size 9T; ...`)."""
    items = [x.strip() for x in (value.split(",") if value else default) if x.strip()]
    bad = [x for x in items if known is not None and x not in known]
    if not items or bad:
        expected = f"a comma list of {', '.join(known)}" if known is not None else "a comma list"
        found = f"unknown {item} {', '.join(bad)}" if bad else "nothing"
        example = f"pass e.g. {option} {','.join(list(known)[:2])}" if known is not None else "see --help"
        raise UsageError(f"{option} {value!r}: expected {expected}, found {found}; {example}")
    return items


def batch_sizes(value: str | None, option: str = "--batches", default=()) -> list[int]:
    """A comma list of batch sizes in [1, MAX_BATCH] (`default` when the option was not given)."""
    items = [x.strip() for x in (value.split(",") if value else default) if x.strip()]
    bad = [x for x in items if not (x.isascii() and x.isdigit() and 1 <= int(x) <= MAX_BATCH)]
    if not items or bad:
        raise UsageError(f"{option} {value!r}: expected a comma list of batch sizes in [1, {MAX_BATCH}], found "
                         f"{', '.join(bad) or 'nothing'}; pass e.g. {option} 1,8")
    return [int(x) for x in items]
