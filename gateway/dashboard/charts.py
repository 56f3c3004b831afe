"""Server-side SVG charts for the console: no JavaScript, no CDN, so every page works offline and prints.

A chart is a pure function of its data. Each drawn point is a ``<circle class="point">`` carrying its series
and values (``data-series``, ``data-x``, ``data-y``) and a ``<title>`` tooltip, so a reader hovers for the figure
and a test counts what was drawn. Missing values (None, NaN) leave a gap instead of a fake zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")
WIDTH, HEIGHT = 560, 200
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 48, 12, 12, 28
INNER_W, INNER_H = WIDTH - PAD_LEFT - PAD_RIGHT, HEIGHT - PAD_TOP - PAD_BOTTOM


@dataclass(slots=True)
class Series:
    name: str
    points: Sequence[tuple[float, float | None]]  # (x, y); y None: no value at that x


def _finite(y: float | None) -> bool:
    return y is not None and math.isfinite(y)


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000 or abs(value) < 0.01:
        return f"{value:.2g}"
    return f"{value:.3g}"


def _bounds(values: list[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if low == high:  # a flat line sits in the middle of a band around its value
        pad = abs(low) * 0.1 or 1.0
        return low - pad, high + pad
    return low, high


@dataclass(frozen=True, slots=True)
class _Frame:
    """The plotted ranges, and where a value falls inside the axes."""

    x0: float
    x1: float
    y0: float
    y1: float

    def px(self, x: float) -> float:
        return PAD_LEFT + (x - self.x0) / (self.x1 - self.x0) * INNER_W

    def py(self, y: float) -> float:
        return PAD_TOP + (1 - (y - self.y0) / (self.y1 - self.y0)) * INNER_H


def line_chart(title: str, series: Sequence[Series], *, x_label: str = "", y_label: str = "") -> str:
    """An SVG line chart (a string of markup) of ``series`` sharing both axes."""
    xs = [x for s in series for x, _ in s.points]
    ys = [float(y) for s in series for _, y in s.points if _finite(y)]  # type: ignore[arg-type]
    head = (
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>'
    )
    if not xs or not ys:
        return (
            head + f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="empty">no data yet</text></svg>'
        )
    frame = _Frame(*_bounds([float(x) for x in xs]), *_bounds(ys))
    parts = [head, *_axes(frame, x_label, y_label)]
    for i, s in enumerate(series):
        parts.extend(_marks(frame, s, PALETTE[i % len(PALETTE)]))
    if len(series) > 1:
        parts.extend(_legend(series))
    parts.append("</svg>")
    return "".join(parts)


def _axes(frame: _Frame, x_label: str, y_label: str) -> list[str]:
    """The two axes, the range at each end of them, and their labels."""
    x0, x1, y0, y1, py = frame.x0, frame.x1, frame.y0, frame.y1, frame.py
    bottom, right = PAD_TOP + INNER_H, PAD_LEFT + INNER_W
    return [
        f'<g class="axes" stroke="#9ca3af" stroke-width="1"><line x1="{PAD_LEFT}" y1="{bottom}" x2="{right}" '
        f'y2="{bottom}"/><line x1="{PAD_LEFT}" y1="{PAD_TOP}" x2="{PAD_LEFT}" y2="{bottom}"/></g>',
        f'<g class="ticks" font-size="10" fill="#4b5563">'
        f'<text x="{PAD_LEFT - 4}" y="{py(y1) + 4:.1f}" text-anchor="end">{_fmt(y1)}</text>'
        f'<text x="{PAD_LEFT - 4}" y="{py(y0) + 4:.1f}" text-anchor="end">{_fmt(y0)}</text>'
        f'<text x="{PAD_LEFT}" y="{bottom + 14}" text-anchor="start">{_fmt(x0)}</text>'
        f'<text x="{right}" y="{bottom + 14}" text-anchor="end">{_fmt(x1)}</text>'
        f'<text x="{PAD_LEFT + INNER_W / 2}" y="{bottom + 24}" text-anchor="middle">{escape(x_label)}</text>'
        f'<text x="10" y="{PAD_TOP + INNER_H / 2}" text-anchor="middle" '
        f'transform="rotate(-90 10 {PAD_TOP + INNER_H / 2})">{escape(y_label)}</text></g>',
    ]


def _marks(frame: _Frame, s: Series, color: str) -> list[str]:
    """One series: a polyline per run of values (a missing value breaks the line), then a point per value."""
    px, py = frame.px, frame.py
    name = escape(s.name)
    parts = []
    segments: list[list[str]] = [[]]
    for x, y in s.points:
        if _finite(y):
            segments[-1].append(f"{px(float(x)):.1f},{py(float(y)):.1f}")  # type: ignore[arg-type]
        elif segments[-1]:
            segments.append([])
    for seg in segments:
        if len(seg) > 1:
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(seg)}"/>')
    for x, y in s.points:
        if _finite(y):
            fy = float(y)  # type: ignore[arg-type]
            parts.append(
                f'<circle class="point" data-series="{name}" data-x="{x:g}" data-y="{fy:g}" '
                f'cx="{px(float(x)):.1f}" cy="{py(fy):.1f}" r="2.5" fill="{color}">'
                f"<title>{name}: {_fmt(fy)} at {x:g}</title></circle>"
            )
    return parts


def _legend(series: Sequence[Series]) -> list[str]:
    legend = ['<g class="legend" font-size="10">']
    for i, s in enumerate(series):
        lx = PAD_LEFT + 8 + i * 130
        legend.append(
            f'<rect x="{lx}" y="{PAD_TOP}" width="10" height="3" fill="{PALETTE[i % len(PALETTE)]}"/>'
            f'<text x="{lx + 14}" y="{PAD_TOP + 4}" fill="#374151">{escape(s.name)}</text>'
        )
    legend.append("</g>")
    return legend


def logprob_colour(logprob: float) -> str:
    """A background for a sampled token by its probability: red for unlikely, through yellow, to green for sure."""
    p = math.exp(max(min(logprob, 0.0), -50.0))
    hue = int(120 * p)  # 0 = red, 60 = yellow, 120 = green
    return f"hsl({hue}, 85%, 85%)"


__all__ = ["Series", "line_chart", "logprob_colour"]
