"""Live engine panels (pyqtgraph): expert hit rate, SSD traffic, RAM vs budget, residency map.

Every curve is created once; events only write into preallocated ring buffers, and a QTimer
redraws (``setData``) at most every ``REDRAW_MS`` when something changed (pyqtgraph
``scrollingPlots.py`` idiom). No redraw ever happens inside a signal handler.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, QSize, Qt, QTimer
from PySide6.QtGui import QFontMetrics, QTextOption
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from engine import ABSENT, LOADING, PINNED, REMOTE, RESIDENT, Loaded, ResidencySnapshot, StepMetrics

from .resources import SCHEMES, THEME

REDRAW_MS = 100
HISTORY = 600          # points kept per curve
ROLLING = 12           # rolling-mean window (points)
CELL_PX = 10           # heat-map cell size in image pixels (last row/column is the grid gap)
X_STEP = 50            # token axes move in steps of this many tokens
LEGEND_S = 0.3         # legend numbers refresh at most this often

# Palette (shared with the legends).
C_PINNED = (232, 145, 30)
C_LRU = (66, 133, 244)
C_MEAN = (30, 36, 48)
C_DEMAND = (219, 68, 85)
C_SPEC = (155, 120, 230)
C_RSS = (66, 133, 244)
C_CACHE = (46, 170, 120)
C_BUDGET = (219, 68, 85)
STATE_RGB = {ABSENT: (118, 124, 138), RESIDENT: (66, 133, 244), PINNED: (245, 166, 35), LOADING: (52, 199, 89),
             REMOTE: (156, 92, 214)}  # REMOTE: in a cluster worker's RAM (expert-parallel serving)
GAP_RGB = (24, 27, 33)
ROUTED_RGB = (255, 255, 255)
DIM_RGB = (0, 0, 0)     # a rarely used expert fades towards this (the map's background)


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    h = hex_colour.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def heat_colours(scheme: dict) -> tuple[tuple, tuple, tuple]:
    """(gap, routed outline, fade-to) colours of the residency map for a colour scheme
    (resources.SCHEMES entry): on a dark map rare experts fade to black, on a light one to the
    map's light background."""
    bg = _rgb(scheme["heat_bg"])
    dim = DIM_RGB if sum(bg) < 3 * 128 else bg
    return _rgb(scheme["heat_gap"]), _rgb(scheme["heat_routed"]), dim


def _hex(c) -> str:
    return "#%02x%02x%02x" % c


def _swatch(c, text: str, outline: bool = False, bg: str = "#181b21", fg: str = "#ffffff") -> str:
    if outline:
        box = f"<span style='background-color:{bg};color:{fg}'>&#9633;</span>"
        return f"<span style='white-space:nowrap'>{box}&nbsp;{text}</span>"
    return f"<span style='white-space:nowrap'><span style='color:{_hex(c)}'>&#9632;</span>&nbsp;{text}</span>"


class Ring:
    """Fixed-capacity ring buffer of several float series sharing one x axis.

    Stored twice over (length 2 x capacity) so :meth:`view` is always one contiguous slice:
    appends write at i and i + capacity, no copying on read.
    """

    def __init__(self, names: tuple[str, ...], capacity: int = HISTORY):
        self.names = names
        self.capacity = capacity
        self.buf = np.zeros((len(names) + 1, 2 * capacity))  # row 0 = x
        self.count = 0   # total appended
        self.i = 0       # next write position in [0, capacity)

    def append(self, x: float, *values: float) -> None:
        """Append one point (x, then one value per series, in ``names`` order)."""
        col = (x, *values)
        self.buf[:, self.i] = col
        self.buf[:, self.i + self.capacity] = col
        self.i = (self.i + 1) % self.capacity
        self.count += 1

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def view(self) -> np.ndarray:
        """[1 + series, n] oldest first: row 0 is x, then each series."""
        n = len(self)
        start = self.i + self.capacity - n
        return self.buf[:, start:start + n]

    def series(self, name: str) -> np.ndarray:
        """One series, oldest first."""
        return self.view()[1 + self.names.index(name)]

    def x(self) -> np.ndarray:
        """The x values, oldest first."""
        return self.view()[0]

    def clear(self) -> None:
        """Forget every point (capacity unchanged)."""
        self.count = self.i = 0


def nice_ceiling(v: float, floor: float) -> float:
    """The smallest 1 / 2 / 5 x 10^k at or above ``v`` (at least ``floor``): axis tops that
    change rarely."""
    v = max(v, floor)
    e = 10.0 ** math.floor(math.log10(v))
    for m in (1.0, 2.0, 5.0, 10.0):
        if m * e >= v * (1 - 1e-9):
            return m * e
    return 10.0 * e


def rolling_mean(y: np.ndarray, w: int) -> np.ndarray:
    """Trailing mean over up to ``w`` points (shorter at the start)."""
    if len(y) == 0:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - w, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def residency_rgb(snap: ResidencySnapshot, cell: int = CELL_PX, cell_h: int | None = None,
                  colours: tuple[tuple, tuple, tuple] = (GAP_RGB, ROUTED_RGB, DIM_RGB)) -> np.ndarray:
    """uint8 [L * cell_h, E * cell, 3] image: state colour per expert, brightness from the log of
    its routing count, and the experts routed for the latest token marked white.

    ``cell`` x ``cell_h`` (default square) are the pixels of one expert; the panel passes the
    on-screen size, so the image is drawn about 1:1 and stays crisp from 8 x 32 to 128 x 48
    experts x layers. A 1-px dark grid gap is drawn along a dimension whose cells are at least
    4 px; a routed expert gets a white outline when its cell is at least 5 x 5 px, else it is
    filled white (an outline would not survive at 3 px). ``colours``: (gap, routed, fade-to) RGB
    (heat_colours of the colour scheme; default: the dark map).
    """
    gap_rgb, routed_rgb, dim_rgb = colours
    cw, ch = max(1, int(cell)), max(1, int(cell_h if cell_h is not None else cell))
    L, E = snap.num_layers, snap.num_experts
    state = np.asarray(snap.state, np.int16).reshape(L, E)
    heat = np.log1p(np.asarray(snap.heat, np.float64).reshape(L, E))
    routed = np.asarray(snap.routed, bool).reshape(L, E)
    top = heat.max()
    h = heat / top if top > 0 else np.zeros_like(heat)
    lut = np.zeros((len(STATE_RGB), 3))
    for s, rgb in STATE_RGB.items():
        lut[s] = rgb
    base = lut[np.clip(state, 0, len(STATE_RGB) - 1)]                                   # [L, E, 3]
    f = (0.35 + 0.65 * h)[..., None]
    colour = np.asarray(dim_rgb, np.float64) * (1 - f) + base * f
    img = np.repeat(np.repeat(colour, ch, axis=0), cw, axis=1)         # [L*ch, E*cw, 3]
    yy = np.arange(L * ch) % ch
    xx = np.arange(E * cw) % cw
    gap_y, gap_x = ch >= 4, cw >= 4
    rmask = np.repeat(np.repeat(routed, ch, axis=0), cw, axis=1)
    if cw >= 5 and ch >= 5:
        ey, ex = ch - 1 - gap_y, cw - 1 - gap_x   # last pixel of the cell before the gap
        ring = (yy[:, None] == 0) | (yy[:, None] == ey) | (xx[None, :] == 0) | (xx[None, :] == ex)
        rmask &= ring
    img[rmask] = routed_rgb
    gap = np.zeros((L * ch, E * cw), bool)
    if gap_y:
        gap |= (yy == ch - 1)[:, None]
    if gap_x:
        gap |= (xx == cw - 1)[None, :]
    img[gap] = gap_rgb
    return img.astype(np.uint8)


LABEL_OVERHANG_PX = 12       # how far a plot's first x label may reach left of its axis (else pyqtgraph hides it)
TICK_GAP_PX = 6              # least space between two tick labels of the residency map


class _Card(QFrame):
    """A titled panel: title, legend line, then the plot."""

    def __init__(self, title: str, plot: QWidget, legend: QLabel, accessible: str):
        super().__init__()
        self.setObjectName("panelCard")
        self.setAccessibleName(accessible)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 8, 10, 8)
        lay.setSpacing(2)
        t = QLabel(title)
        t.setObjectName("panelTitle")
        lay.addWidget(t)
        legend.setObjectName("panelLegend")
        legend.setTextFormat(Qt.RichText)
        legend.setWordWrap(True)
        lay.addWidget(legend)
        lay.addWidget(plot, 1)


class _PlotWidget(pg.PlotWidget):
    def sizeHint(self):  # pyqtgraph's default hint is large; let the dock share the height
        return QSize(320, 100)


class _BottomAxis(pg.AxisItem):
    """The x axis, whose first tick label may overhang its left end (over the empty corner
    under the y axis) by LABEL_OVERHANG_PX: pyqtgraph hides a label reaching past the axis,
    and with the grid on it ignores its own ``hideOverlappingLabels`` tolerance, so a narrow
    panel lost its "0". The right end stays strict: past it a label would be cut by the card."""

    def boundingRect(self):  # noqa: N802 - Qt's name
        return super().boundingRect().adjusted(-LABEL_OVERHANG_PX, 0, 0, 0)


def _plot(left: str, bottom: str = "token") -> pg.PlotWidget:
    w = _PlotWidget(background="w", axisItems={"bottom": _BottomAxis("bottom")})
    w.setMinimumHeight(90)
    w.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Expanding)
    p = w.getPlotItem()
    p.setMenuEnabled(False)
    p.hideButtons()
    p.showGrid(x=True, y=True, alpha=0.15)
    for ax in ("left", "bottom"):
        p.getAxis(ax).setPen(pg.mkPen("#9aa0a6"))
        p.getAxis(ax).setTextPen(pg.mkPen("#5f6368"))
    p.setLabel("left", left, color="#5f6368")
    p.setLabel("bottom", bottom, color="#5f6368")
    for ax in ("left", "bottom"):
        p.getAxis(ax).enableAutoSIPrefix(False)
    w.setMouseEnabled(x=False, y=False)
    return w


def _fill(plot, rgb, alpha: int) -> pg.PlotDataItem:
    # Antialiased fills and wide antialiased pens cost ~10-20 ms per repaint in the raster
    # engine; a filled area with a 1-px outline, not antialiased, costs ~2 ms.
    return plot.plot(pen=pg.mkPen(rgb, width=1), fillLevel=0, brush=pg.mkBrush(*rgb, alpha), antialias=False)


class PlotPanels(QWidget):
    """The four live panels, fed by :meth:`on_loaded`, :meth:`on_metrics`, :meth:`on_residency`.

    Data buffers (read by tests): ``hit_ring`` (pinned, lru, hit), ``ssd_ring`` (demand MB,
    speculative MB), ``ram_ring`` (rss GB, cache GB), ``budget_gb``, ``heat_image`` (last RGB).
    """

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setAccessibleName("Engine panels")
        self.hit_ring = Ring(("pinned", "lru", "hit"))
        self.ssd_ring = Ring(("demand", "spec"))
        self.ram_ring = Ring(("rss", "cache"))
        self.budget_gb = 0.0
        self.heat_image: np.ndarray | None = None
        self.snapshot: ResidencySnapshot | None = None
        self.redraws = 0
        self._x_base = 0
        self._last_index = -1
        self._dirty_lines = self._dirty_heat = False
        self._heat_shape = (0, 0)
        self.moe_layers: tuple[int, ...] = ()  # the transformer layer of each map row (Loaded)
        self._ranges: dict = {}
        self._legend_t = 0.0

        # 1. hit rate: stacked (pinned below, other cached hits above) + rolling mean
        self.hit_plot = _plot("%")
        hp = self.hit_plot.getPlotItem()
        hp.setYRange(0, 100, padding=0.02)
        self.curve_hit = _fill(hp, C_LRU, 110)
        self.curve_pinned = _fill(hp, C_PINNED, 170)
        self.curve_mean = hp.plot(pen=pg.mkPen(C_MEAN, width=2), antialias=False)
        self.hit_legend = QLabel()
        self._set_hit_legend(None)

        # 2. SSD MB per token: demand below, speculative stacked on top
        self.ssd_plot = _plot("MB")
        sp = self.ssd_plot.getPlotItem()
        self.curve_total = _fill(sp, C_SPEC, 110)
        self.curve_demand = _fill(sp, C_DEMAND, 150)
        self.ssd_legend = QLabel()
        self._set_ssd_legend(None)

        # 3. RAM: RSS and expert cache vs the budget line (GB)
        self.ram_plot = _plot("GB")
        rp = self.ram_plot.getPlotItem()
        self.curve_rss = rp.plot(pen=pg.mkPen(C_RSS, width=2), antialias=False)
        self.curve_cache = _fill(rp, C_CACHE, 60)
        self.budget_line = pg.InfiniteLine(pos=0, angle=0, pen=pg.mkPen(C_BUDGET, width=1.5, style=Qt.DashLine))
        rp.addItem(self.budget_line)
        self.ram_legend = QLabel()
        self._set_ram_legend(None)

        # 4. residency heat map: layers x experts
        self.heat_plot = _plot("layer", "expert")
        self.heat_plot.setBackground((24, 27, 33))
        hm = self.heat_plot.getPlotItem()
        hm.showGrid(x=False, y=False)
        hm.invertY(True)
        hm.setAspectLocked(False)
        self.heat_item = pg.ImageItem(axisOrder="row-major")
        self.heat_item.setLevels((0, 255))
        hm.addItem(self.heat_item)
        hm.getViewBox().sigResized.connect(self._heat_resized)  # rebuild the image at the new cell size
        self.heat_legend = QLabel()
        self.show_remote = False  # the legend names REMOTE once a snapshot has such an expert
        self.heat_title = "Expert residency (MoE layers × experts)"

        self.grid = QGridLayout(self)
        self.grid.setContentsMargins(8, 8, 8, 8)
        self.grid.setSpacing(8)
        self.cards = [
            _Card("Expert cache hit rate per token (%)", self.hit_plot, self.hit_legend, "Hit rate panel"),
            _Card("SSD reads per token (MB)", self.ssd_plot, self.ssd_legend, "SSD traffic panel"),
            _Card("RAM vs budget (GB)", self.ram_plot, self.ram_legend, "RAM panel"),
            _Card(self.heat_title, self.heat_plot, self.heat_legend, "Residency heat map panel"),
        ]
        self.columns = 0
        self.set_columns(1)

        # sensible empty views until data arrives
        for w in (self.hit_plot, self.ssd_plot, self.ram_plot):
            w.getPlotItem().setXRange(0, 50, padding=0.02)
        sp.setYRange(0, 1, padding=0)
        rp.setYRange(0, 1, padding=0)
        self.heat_hint = pg.TextItem("the map fills in while the model answers", color=(150, 156, 168), anchor=(0.5, 0.5))
        # wrapped and centred inside the map (its width follows the view: _heat_resized), so a
        # narrow panel never cuts it or draws it over the axis labels
        self.heat_hint.textItem.document().setDefaultTextOption(QTextOption(Qt.AlignHCenter))
        hm.addItem(self.heat_hint)
        hm.setXRange(0, 8, padding=0)
        hm.setYRange(0, 2, padding=0)
        self.heat_hint.setPos(4, 1)
        for ax in ("left", "bottom"):
            hm.getAxis(ax).setTicks([[]])

        self.timer = QTimer(self)
        self.timer.setInterval(REDRAW_MS)
        self.timer.timeout.connect(self.redraw)
        self.timer.start()
        self.scheme = ""
        self.apply_scheme(THEME.scheme)
        THEME.changed.connect(self.apply_scheme)

    def set_columns(self, n: int) -> None:
        """Lay the four cards out in ``n`` columns: 1 in a side dock (stacked, the map tallest),
        2 (two rows) when the dock sits under the chat in a narrow window."""
        n = max(1, min(4, int(n)))
        if n == self.columns:
            return
        self.columns = n
        for c in self.cards:
            self.grid.removeWidget(c)
        rows = (len(self.cards) + n - 1) // n
        for r in range(4):
            self.grid.setRowStretch(r, 0)
        for c in range(4):
            self.grid.setColumnStretch(c, 0)
        for i, card in enumerate(self.cards):
            self.grid.addWidget(card, i // n, i % n)
        stretches = (2, 2, 2, 3) if n == 1 else (1,) * rows
        for r in range(rows):
            self.grid.setRowStretch(r, stretches[r])
        for c in range(n):
            self.grid.setColumnStretch(c, 1)

    def resizeEvent(self, e) -> None:  # noqa: N802 - Qt's name
        """Keep the panels' minimum height at what their cards need at this width (a narrow
        dock wraps the legends onto more lines): Qt's minimum size ignores wrapped labels, so a
        small window squeezed the cards and cut the plots' axis labels off at the bottom."""
        super().resizeEvent(e)
        need = self.grid.totalMinimumHeightForWidth(self.width())
        if need > 0 and need != self.minimumHeight():
            self.setMinimumHeight(need)

    def apply_scheme(self, scheme: str) -> None:
        """Repaint the plots in a colour scheme (resources.LIGHT / DARK): backgrounds, axes,
        the mean line, and the residency map (its background, grid gap and routed outline)."""
        col = SCHEMES[scheme]
        self.scheme = scheme
        for w in (self.hit_plot, self.ssd_plot, self.ram_plot):
            w.setBackground(col["plot_bg"])
        for w in (self.hit_plot, self.ssd_plot, self.ram_plot, self.heat_plot):
            p = w.getPlotItem()
            for ax in ("left", "bottom"):
                p.getAxis(ax).setPen(pg.mkPen(col["plot_axis"]))
                p.getAxis(ax).setTextPen(pg.mkPen(col["plot_text"]))
                p.getAxis(ax).label.setDefaultTextColor(pg.mkColor(col["plot_text"]))
        self.curve_mean.setPen(pg.mkPen(col["plot_mean"], width=2))
        self._set_hit_legend(getattr(self, "_hit_values", None))  # the mean's swatch recoloured, values kept
        self.heat_plot.setBackground(col["heat_bg"])
        self.heat_hint.setColor(col["muted"])
        self._heat_colours = heat_colours(col)
        self.heat_legend.setText(" &nbsp; ".join([
            _swatch(STATE_RGB[ABSENT], "absent"), _swatch(STATE_RGB[RESIDENT], "resident"),
            _swatch(STATE_RGB[PINNED], "pinned"), _swatch(STATE_RGB[LOADING], "loading"),
            *([_swatch(STATE_RGB[REMOTE], "on another computer")] if self.show_remote else []),
            _swatch(None, "routed now", outline=True, bg=col["heat_bg"], fg=col["heat_routed"]),
            f"<span style='color:{col['muted']}'>brightness = log routing count</span>"]))
        if self.snapshot is not None:
            self._dirty_heat = True

    # --- inputs (cheap: buffers only) ---------------------------------------------------------

    def on_loaded(self, ev: Loaded) -> None:
        """A model was opened: reset the history, set the budget line and the map size."""
        for r in (self.hit_ring, self.ssd_ring, self.ram_ring):
            r.clear()
        self._x_base, self._last_index = 0, -1
        self.budget_gb = ev.ram_budget_bytes / 1e9
        self.moe_layers = tuple(getattr(ev, "moe_layers", ()) or ())
        self._ticks_for = None
        self.snapshot = None
        self.heat_image = None
        hm = self.heat_plot.getPlotItem()
        hm.setXRange(0, ev.num_experts, padding=0)
        hm.setYRange(0, ev.num_layers, padding=0)
        self._set_ticks(ev.num_layers, ev.num_experts)
        self._heat_shape = (ev.num_layers, ev.num_experts)
        self.heat_hint.setPos(ev.num_experts / 2, ev.num_layers / 2)
        self.heat_hint.setVisible(True)
        self.heat_item.clear()
        self._dirty_lines = self._dirty_heat = True

    def new_generation(self) -> None:
        """Continue the x axis after the previous answer instead of restarting at 0."""
        if self._last_index >= 0:
            self._x_base += self._last_index + 1
            self._last_index = -1

    def on_metrics(self, m: StepMetrics) -> None:
        """Record one StepMetrics."""
        x = self._x_base + m.token_index
        self._last_index = max(self._last_index, m.token_index)
        pinned = 100.0 * m.pinned_hit_rate
        self.hit_ring.append(x, pinned, pinned + 100.0 * m.lru_hit_rate, 100.0 * m.hit_rate)
        self.ssd_ring.append(x, m.demand_bytes / 1e6, m.speculative_bytes / 1e6)
        self.ram_ring.append(x, m.rss_bytes / 1e9, m.cache_bytes / 1e9)
        if m.budget_bytes:
            self.budget_gb = m.budget_bytes / 1e9
        self.answer_rates = (m.total_hit_rate, m.total_mb_per_token)
        self.draft_rates = (m.tokens_per_forward, m.draft_acceptance)
        self._dirty_lines = True

    def on_finished(self, ev) -> None:
        """The answer ended: the legends show its whole-answer hit rate and MB/token, the very
        numbers of the line under the answer (Finished; StepMetrics.total_* while streaming)."""
        self.answer_rates = (ev.hit_rate, ev.mb_per_token)
        self.draft_rates = (ev.tokens_per_forward, ev.draft_acceptance)
        self._legend_t = 0.0
        self._dirty_lines = True
        self.redraw()

    def on_residency(self, snap: ResidencySnapshot) -> None:
        """Record the latest residency snapshot (drawn on the next tick)."""
        self.snapshot = snap
        self._dirty_heat = True
        if not self.show_remote and REMOTE in snap.state:
            self.show_remote = True
            self.apply_scheme(self.scheme)

    # --- drawing (timer) ----------------------------------------------------------------------

    def redraw(self) -> None:
        """Push the buffers to the curves (timer slot; no-op when nothing changed)."""
        if self._dirty_lines:
            self._dirty_lines = False
            self._draw_lines()
        if self._dirty_heat and self.snapshot is not None:
            self._dirty_heat = False
            self.heat_hint.setVisible(False)
            s = self.snapshot
            self.heat_image = residency_rgb(s, *self._cell_px(s.num_layers, s.num_experts), self._heat_colours)
            self.heat_item.setImage(self.heat_image, levels=(0, 255), autoLevels=False)
            self.heat_item.setRect(QRectF(0, 0, s.num_experts, s.num_layers))
            if self._heat_shape != (s.num_layers, s.num_experts):
                self._heat_shape = (s.num_layers, s.num_experts)
                hm = self.heat_plot.getPlotItem()
                hm.setXRange(0, s.num_experts, padding=0)
                hm.setYRange(0, s.num_layers, padding=0)
                self._set_ticks(s.num_layers, s.num_experts)
        self.redraws += 1

    def _cell_px(self, layers: int, experts: int) -> tuple[int, int]:
        """On-screen pixels of one heat-map cell (width, height), at least 1: the image is built
        at this size so it is shown about 1:1 (no aliased grid lines at 128 x 48)."""
        vb = self.heat_plot.getPlotItem().getViewBox()
        dpr = self.heat_plot.devicePixelRatioF() or 1.0
        w, h = vb.width() * dpr, vb.height() * dpr
        if w < 8 or h < 8:  # not laid out yet
            return CELL_PX, CELL_PX
        return max(1, int(w // max(1, experts))), max(1, int(h // max(1, layers)))

    def _heat_resized(self) -> None:
        vb = self.heat_plot.getPlotItem().getViewBox()
        room = max(40.0, vb.width() - 12.0)
        if abs(self.heat_hint.textItem.textWidth() - room) >= 1:
            self.heat_hint.setTextWidth(room)
        if self._heat_shape != (0, 0):
            self._set_ticks(*self._heat_shape)
        if self.snapshot is not None:
            self._dirty_heat = True

    def _draw_lines(self) -> None:
        # Ranges move in steps and legends refresh at ~3 Hz: every range change re-lays out an
        # axis and every label change re-lays out the card, which costs more than the curves.
        now = time.monotonic()
        legends = now - self._legend_t >= LEGEND_S
        if legends:
            self._legend_t = now
        h = self.hit_ring.view()
        x = h[0]
        if len(x):
            mean = rolling_mean(h[3], ROLLING)
            self.curve_pinned.setData(x, h[1], skipFiniteCheck=True)
            self.curve_hit.setData(x, h[2], skipFiniteCheck=True)
            self.curve_mean.setData(x, mean, skipFiniteCheck=True)
            if legends:
                self._set_hit_legend((h[1][-1], h[2][-1] - h[1][-1], float(mean[-1])))
        else:
            for c in (self.curve_pinned, self.curve_hit, self.curve_mean):
                c.setData([], [])
            self._set_hit_legend(None)
        s = self.ssd_ring.view()
        if len(s[0]):
            total = s[1] + s[2]
            self.curve_demand.setData(s[0], s[1], skipFiniteCheck=True)
            self.curve_total.setData(s[0], total, skipFiniteCheck=True)
            if legends:
                self._set_ssd_legend((float(s[1][-ROLLING:].mean()), float(s[2][-ROLLING:].mean())))
            self._set_range(self.ssd_plot, "y", 0.0, nice_ceiling(float(total.max()) * 1.1, 0.05))
        else:
            self.curve_demand.setData([], [])
            self.curve_total.setData([], [])
            self._set_ssd_legend(None)
        x0 = math.floor(float(x[0]) / X_STEP) * X_STEP if len(x) else 0.0
        x1 = max(math.ceil((float(x[-1]) + 1) / X_STEP) * X_STEP if len(x) else 0.0, x0 + X_STEP)
        for w in (self.hit_plot, self.ssd_plot, self.ram_plot):
            self._set_range(w, "x", x0, x1)
        r = self.ram_ring.view()
        self.budget_line.setPos(self.budget_gb)
        top = max(self.budget_gb, float(r[1].max()) if len(r[0]) else 0.0, 0.01) * 1.08
        self._set_range(self.ram_plot, "y", 0.0, nice_ceiling(top, 0.05))
        if len(r[0]):
            self.curve_rss.setData(r[0], r[1], skipFiniteCheck=True)
            self.curve_cache.setData(r[0], r[2], skipFiniteCheck=True)
            if legends:
                self._set_ram_legend((float(r[1][-1]), float(r[2][-1]), self.budget_gb))
        else:
            self.curve_rss.setData([], [])
            self.curve_cache.setData([], [])
            self._set_ram_legend((None, None, self.budget_gb) if self.budget_gb else None)

    def _set_range(self, w: pg.PlotWidget, axis: str, lo: float, hi: float) -> None:
        key = (id(w), axis)
        if self._ranges.get(key) == (lo, hi):
            return
        self._ranges[key] = (lo, hi)
        p = w.getPlotItem()
        if axis == "x":
            p.setXRange(lo, hi, padding=0.02)
        else:
            p.setYRange(lo, hi, padding=0)

    def tick_steps(self, layers: int, experts: int) -> tuple[int, int]:
        """(layer step, expert step) of the residency map's tick labels: at most 8 labels per
        axis, and labels far enough apart on screen that they never touch (an expert label
        needs its width plus a gap, a layer label its line height), for the map's current
        size in pixels (a narrow window packs 32 experts into ~250 px)."""
        vb = self.heat_plot.getPlotItem().getViewBox()
        fm = QFontMetrics(self.heat_plot.getPlotItem().getAxis("bottom").style.get("tickFont") or self.font())
        step_e = max(1, math.ceil(experts / 8))
        step_l = max(1, math.ceil(layers / 8))
        if vb.width() >= 8 and vb.height() >= 8:
            cell_w, cell_h = vb.width() / max(1, experts), vb.height() / max(1, layers)
            step_e = max(step_e, math.ceil((fm.horizontalAdvance(str(max(0, experts - 1))) + TICK_GAP_PX) / cell_w))
            step_l = max(step_l, math.ceil((fm.height() + 1) / cell_h))
        return step_l, step_e

    def _set_ticks(self, layers: int, experts: int) -> None:
        step_l, step_e = self.tick_steps(layers, experts)
        if (step_l, step_e, layers, experts) == getattr(self, "_ticks_for", None):
            return
        self._ticks_for = (step_l, step_e, layers, experts)
        hm = self.heat_plot.getPlotItem()
        hm.getAxis("bottom").setTicks([[(e + 0.5, str(e)) for e in range(0, experts, step_e)]])
        hm.getAxis("left").setTicks([[(r + 0.5, str(n)) for r, n in self.layer_ticks(layers, step_l)]])

    def layer_ticks(self, layers: int, step: int) -> list[tuple[int, int]]:
        """(row, label) of the map's layer ticks: rows are MoE layers, labelled with their
        transformer layer (DeepSeek-V3's first MoE row is layer 3: its 3 dense layers have no
        row), at the layers that are multiples of ``step`` when those are ``step`` rows apart
        (consecutive MoE layers), else every ``step``-th row."""
        ids = self.moe_layers if len(self.moe_layers) == layers else tuple(range(layers))
        rows = [r for r in range(layers) if ids[r] % step == 0]
        if len(rows) < 2 or any(b - a < step for a, b in zip(rows, rows[1:])):
            rows = list(range(0, layers, step))
        return [(r, ids[r]) for r in rows]

    # --- legends ------------------------------------------------------------------------------

    def _answer_texts(self) -> tuple[str, str]:
        """("hit rate N%", "X MB/token") of the answer so far, formatted by the answer line's
        own function (chat_view.rates_text)."""
        from .chat_view import rates_text
        r = getattr(self, "answer_rates", None)
        if r is None:
            return "hit rate –", "– MB/token"
        return rates_text(r[0], r[1])

    def _set_hit_legend(self, v) -> None:
        self._hit_values = v
        pin, lru, mean = ("–", "–", "–") if v is None else (f"{v[0]:.0f}%", f"{v[1]:.0f}%", f"{v[2]:.0f}%")
        self.hit_legend.setText(" &nbsp; ".join([
            _swatch(C_PINNED, f"pinned {pin}"), _swatch(C_LRU, f"cached {lru}"),
            _swatch(_rgb(SCHEMES[getattr(self, "scheme", "") or "light"]["plot_mean"]), f"rolling mean {mean}"),
            f"<span style='white-space:nowrap'>answer: {self._answer_texts()[0]}</span>"]))

    def _set_ssd_legend(self, v) -> None:
        d, s = ("–", "–") if v is None else (f"{v[0]:.2f}", f"{v[1]:.2f}")
        self.ssd_legend.setText(" &nbsp; ".join([
            _swatch(C_DEMAND, f"demand {d} MB"), _swatch(C_SPEC, f"speculative {s} MB"),
            "<span style='color:#80868b'>(stacked)</span>",
            f"<span style='white-space:nowrap'>answer: {self._answer_texts()[1]}</span>",
            *([f"<span style='white-space:nowrap'>{self._draft_text()}</span>"] if self._draft_text() else [])]))

    def _draft_text(self) -> str:
        """"N.NN tokens/forward, drafts P% kept" of the answer so far (speculative decoding;
        chat_view.draft_text), or "" before a decode forward."""
        from .chat_view import draft_text
        r = getattr(self, "draft_rates", None)
        return "" if r is None or r[0] <= 0 else draft_text(r[0], r[1])

    def _set_ram_legend(self, v) -> None:
        fmt = lambda x: "–" if x is None else f"{x:.2f} GB"  # noqa: E731
        rss, cache, budget = (None, None, None) if v is None else v
        self.ram_legend.setText(" &nbsp; ".join([
            _swatch(C_RSS, f"RSS {fmt(rss)}"), _swatch(C_CACHE, f"expert cache {fmt(cache)}"),
            _swatch(C_BUDGET, f"budget {fmt(budget)}")]))
