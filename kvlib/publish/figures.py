"""How the book's figures look, and the checks a figure must pass before it is glued.

:func:`apply_style` (called by :class:`kvlib.publish.Run`) sets matplotlib's defaults for every notebook: the
Okabe-Ito colour-blind-safe palette, cycled together with markers and line styles so that no two of the first 24
series share a look, 10 pt text and a resolution that keeps it legible in the book's text column.

:func:`figure_problems` (called by :meth:`kvlib.publish.Run.glue_fig`, which refuses a figure that has any) reads a
drawn figure back: text smaller than :data:`MIN_TEXT_PX` once the figure is scaled into the text column
(:data:`COLUMN_PX`), two labelled series of one axes with the same colour, line style and marker, and a legend
drawn over data points.
"""

from __future__ import annotations

from typing import Any

#: Okabe & Ito (2008), "Color Universal Design": distinguishable under the common colour-vision deficiencies
OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#B8A000"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
LINESTYLES = ["-", "--", ":"]
#: width (CSS px) of the book's text column at a 1400 px window, where figures are checked
COLUMN_PX = 780
#: the smallest text a reader should meet (CSS px at that width)
MIN_TEXT_PX = 9.0
DPI = 110


def style_cycle():
    """24 (colour, marker, line style) combinations, all distinct: the colour changes every series, the marker
    with it (shifted each round) and the line style every eight series."""
    from cycler import cycler

    n = len(OKABE_ITO)
    rounds = len(LINESTYLES)
    colors = [OKABE_ITO[i % n] for i in range(n * rounds)]
    markers = [MARKERS[(i + i // n) % len(MARKERS)] for i in range(n * rounds)]
    styles = [LINESTYLES[i // n] for i in range(n * rounds)]
    return cycler(color=colors) + cycler(marker=markers) + cycler(linestyle=styles)


def apply_style() -> None:
    import matplotlib as mpl

    mpl.rcParams.update({
        "axes.prop_cycle": style_cycle(),
        "figure.dpi": DPI, "savefig.dpi": DPI,
        "figure.figsize": (6.4, 4.0),
        "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 9.5, "ytick.labelsize": 9.5,
        "legend.fontsize": 9.5, "legend.frameon": True, "legend.framealpha": 0.9,
        "lines.markersize": 5, "lines.linewidth": 1.6,
        "axes.grid": True, "grid.alpha": 0.3,
        "image.cmap": "cividis",
    })
    # the inline backend applies its own rc (dpi, bbox) at each display; give it ours
    try:
        from matplotlib_inline.backend_inline import InlineBackend

        ib = InlineBackend.instance()
        ib.rc = dict(ib.rc, **{"figure.dpi": DPI, "savefig.dpi": DPI})
    except Exception:  # noqa: BLE001 - no IPython here: plain matplotlib
        pass


def _texts(fig) -> list[Any]:
    out = []
    for t in fig.findobj(match=lambda a: a.__class__.__name__ in ("Text", "Annotation")):
        if t.get_visible() and t.get_text().strip() and t.get_figure() is fig:
            out.append(t)
    return out


def figure_problems(fig, name: str = "figure") -> list[str]:
    """Why ``fig`` would not read in the book (empty: it reads)."""

    fig.canvas.draw()
    width_px = fig.get_figwidth() * fig.dpi
    # a saved figure is cropped to its drawn content ("tight" bbox); the inline display does the same
    renderer = fig.canvas.get_renderer()
    bbox = fig.get_tightbbox(renderer)
    if bbox is not None:
        width_px = bbox.width * fig.dpi
    scale = min(1.0, COLUMN_PX / width_px) if width_px > 0 else 1.0
    out = []
    small = sorted({round(t.get_fontsize() * fig.dpi / 72 * scale, 1) for t in _texts(fig)
                    if t.get_fontsize() * fig.dpi / 72 * scale < MIN_TEXT_PX})
    if small:
        out.append(f"{name}: text of {small[0]} px at the text column's width ({COLUMN_PX} px; the figure is "
                   f"{width_px:.0f} px wide): make the figure narrower or its text larger (at least {MIN_TEXT_PX} px)")
    for ax in fig.axes:
        looks: dict[tuple, str] = {}
        for line in ax.get_lines():
            label = line.get_label()
            xy = line.get_xydata()
            if not label or label.startswith("_") or not line.get_visible() or xy is None or not len(xy):
                continue  # seaborn's legend section titles are empty lines
            look = (str(line.get_color()), str(line.get_linestyle()), str(line.get_marker()))
            if look in looks and looks[look] != label:
                out.append(f"{name}: series {looks[look]!r} and {label!r} look the same (colour, line, marker)")
            looks.setdefault(look, label)
        leg = ax.get_legend()
        if leg is None or not leg.get_visible():
            continue
        covered = _legend_covers(ax, leg, fig)
        if covered:
            where = ax.get_title() or fig.axes.index(ax)
            out.append(f"{name}: the legend of axes {where!r} covers data ({covered} line(s) or point(s)): "
                       "place it outside the axes (e.g. loc='upper left', bbox_to_anchor=(1.02, 1))")
    return out


def _column_scale(fig) -> float:
    fig.canvas.draw()
    bbox = fig.get_tightbbox(fig.canvas.get_renderer())
    width_px = (bbox.width if bbox is not None else fig.get_figwidth()) * fig.dpi
    return min(1.0, COLUMN_PX / width_px) if width_px > 0 else 1.0


def make_readable(fig) -> list[str]:
    """Fix what can be fixed without a decision: text below :data:`MIN_TEXT_PX` in the text column is enlarged to
    it, and a legend drawn over data moves outside its axes (right of it); the layout is then redone. Returns what
    was changed (a look shared by two series is left to the author: :func:`figure_problems` refuses it)."""
    import warnings

    changed = []
    for ax in fig.axes:  # legends first: moving one outside widens the figure, which the text check must see
        leg = ax.get_legend()
        if leg is None or not _legend_covers(ax, leg, fig):
            continue
        rightmost = all(a.bbox.x0 < ax.bbox.x1 - 1 for a in fig.axes if a is not ax and a.get_visible()
                        and abs(a.bbox.y0 - ax.bbox.y0) < 1) or len(fig.axes) == 1
        places = [("best", None), *([("upper left", (1.02, 1.0))] if rightmost else []),
                  ("upper center", (0.5, -0.22))]
        for loc, anchor in places:
            leg.set_loc(loc)
            leg.set_bbox_to_anchor(anchor, transform=ax.transAxes if anchor else None)
            _relayout(fig, warnings)
            if not _legend_covers(ax, leg, fig):
                changed.append(f"legend of axes {fig.axes.index(ax)} moved ({loc})")
                break
    for _ in range(4):  # enlarging text widens the figure's drawn box a little: converge
        scale = _column_scale(fig)
        small = [t for t in _texts(fig) if t.get_fontsize() * fig.dpi / 72 * scale < MIN_TEXT_PX]
        if not small:
            break
        need = MIN_TEXT_PX / (fig.dpi / 72 * scale) * 1.05
        for t in small:
            t.set_fontsize(need)
        changed.append(f"{len(small)} text(s) enlarged to {need:.1f} pt")
        _relayout(fig, warnings)
    return changed


def _relayout(fig, warnings) -> None:
    engine = fig.get_layout_engine()
    if engine is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fig.tight_layout()
    fig.canvas.draw()


def _drawn_points(ax):
    """Display coordinates of what ``ax`` draws (lines densely sampled along their segments, markers, scatter
    offsets), only where they fall inside the axes (what lies outside is clipped away)."""
    import numpy as np

    pts = []
    for line in ax.get_lines():
        xy = line.get_xydata()
        if xy is None or not len(xy) or not line.get_visible():
            continue
        p = line.get_transform().transform(np.asarray(xy, dtype=float))
        p = p[np.isfinite(p).all(axis=1)]
        if line.get_linestyle() not in ("None", "", " ", "none") and len(p) > 1:
            seg = np.hypot(*np.diff(p, axis=0).T)
            n = np.clip((seg / 2).astype(int) + 2, 2, 400)
            p = np.concatenate([np.linspace(p[i], p[i + 1], n[i]) for i in range(len(p) - 1)])
        pts.append(p)
    for coll in ax.collections:
        offs = getattr(coll, "get_offsets", lambda: [])()
        if len(offs) and coll.get_visible():
            pts.append(coll.get_offset_transform().transform(offs))
    if not pts:
        return np.zeros((0, 2))
    p = np.concatenate(pts)
    b = ax.bbox
    return p[(p[:, 0] >= b.x0) & (p[:, 0] <= b.x1) & (p[:, 1] >= b.y0) & (p[:, 1] <= b.y1)]


def _legend_covers(ax, leg, fig) -> int:
    """How many drawn data points of any axes of ``fig`` lie under the legend ``leg`` (of ``ax``)."""
    fig.canvas.draw()
    box = leg.get_window_extent(fig.canvas.get_renderer()).padded(-2)
    n = 0
    for a in fig.axes:
        p = _drawn_points(a)
        n += int(((p[:, 0] > box.x0) & (p[:, 0] < box.x1) & (p[:, 1] > box.y0) & (p[:, 1] < box.y1)).sum())
    return n
