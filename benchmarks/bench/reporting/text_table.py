"""Plain-text tables and the number formats of `tandem bench`'s report."""

from __future__ import annotations


def num(v, fmt: str = "{:.3f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def times(v) -> str:
    """A ratio, as 1.23x."""
    return "-" if v is None else f"{v:.2f}x"


def mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f} MiB"


def table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the others right."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])
