"""Ring buffers, the residency image, and the panels' timer-driven redraw."""

from __future__ import annotations

import numpy as np

from engine import ABSENT, LOADING, PINNED, RESIDENT, Loaded, ResidencySnapshot, StepMetrics
from colibri_app.plot_panels import CELL_PX, GAP_RGB, ROUTED_RGB, STATE_RGB, PlotPanels, Ring, residency_rgb, rolling_mean


def test_ring_keeps_the_latest_in_order():
    r = Ring(("a", "b"), capacity=4)
    for i in range(7):
        r.append(i, 10 * i, -i)
    assert len(r) == 4
    assert r.x().tolist() == [3, 4, 5, 6]
    assert r.series("a").tolist() == [30, 40, 50, 60]
    assert r.series("b").tolist() == [-3, -4, -5, -6]
    r.clear()
    assert len(r) == 0 and r.view().shape == (3, 0)


def test_rolling_mean():
    assert rolling_mean(np.array([2.0, 4.0, 6.0, 8.0]), 2).tolist() == [2.0, 3.0, 5.0, 7.0]


def test_residency_image_states_and_routed_outline():
    L, E = 2, 4
    state = (ABSENT, RESIDENT, PINNED, LOADING, RESIDENT, ABSENT, ABSENT, ABSENT)
    heat = (0, 10, 10, 0, 1000, 0, 0, 0)
    routed = (0, 1, 0, 0, 0, 0, 0, 0)
    img = residency_rgb(ResidencySnapshot(L, E, state, heat, routed, 5))
    assert img.shape == (L * CELL_PX, E * CELL_PX, 3) and img.dtype == np.uint8
    centre = lambda l, e: img[l * CELL_PX + CELL_PX // 2, e * CELL_PX + CELL_PX // 2].astype(int)  # noqa: E731
    # hue per state: the dominant channel matches the state colour's
    for (l, e), s in (((0, 1), RESIDENT), ((0, 2), PINNED), ((0, 3), LOADING), ((1, 0), RESIDENT)):
        assert np.argmax(centre(l, e)) == np.argmax(STATE_RGB[s])
    # brightness follows heat: the hottest resident expert is brighter than a cooler one
    assert centre(1, 0).sum() > centre(0, 1).sum()
    # routed expert (0, 1) has a white outline; (0, 2) does not
    assert tuple(img[0, 1 * CELL_PX + 3]) == ROUTED_RGB
    assert tuple(img[0, 2 * CELL_PX + 3]) != ROUTED_RGB
    assert tuple(img[CELL_PX - 1, 5]) == GAP_RGB


def _metrics(i):
    return StepMetrics(token_index=i, hits=3, misses=1, pinned_hits=1, hit_rate=0.75, pinned_hit_rate=0.25,
                       lru_hit_rate=0.5, loads=1, demand_bytes=2_000_000, speculative_bytes=500_000,
                       mb_per_token=2.5, felt_wait_s=0.0, read_service_s=0.0, rss_bytes=3_000_000_000,
                       budget_bytes=8_000_000_000, cache_bytes=1_000_000_000, cap_per_layer=4, tok_per_s=10.0,
                       ttft_s=0.2)


def test_panels_buffer_then_redraw_on_timer(qtbot):
    p = PlotPanels()
    qtbot.addWidget(p)
    p.timer.stop()   # drive the redraw by hand
    p.on_loaded(Loaded("m", "/s", "int8", 2, 4, 2, 512, 4, 8_000_000_000, 1, 1, 1))
    for i in range(5):
        p.on_metrics(_metrics(i))
    p.on_residency(ResidencySnapshot(2, 4, (1,) * 8, (1,) * 8, (0,) * 8, 4))
    assert len(p.curve_hit.xData if p.curve_hit.xData is not None else []) == 0   # nothing drawn yet
    p.redraw()
    assert p.curve_hit.yData.tolist() == [75.0] * 5          # pinned + LRU, stacked
    assert p.curve_pinned.yData.tolist() == [25.0] * 5
    assert p.curve_total.yData.tolist() == [2.5] * 5          # demand + speculative MB
    assert p.curve_demand.yData.tolist() == [2.0] * 5
    assert p.curve_rss.yData.tolist() == [3.0] * 5 and p.budget_line.value() == 8.0
    cw, ch = p._cell_px(2, 4)
    assert p.heat_image is not None and p.heat_image.shape == (2 * ch, 4 * cw, 3)
    # a second answer continues the x axis
    p.new_generation()
    p.on_metrics(_metrics(0))
    p.redraw()
    assert p.hit_ring.x().tolist()[-2:] == [4.0, 5.0]


def test_residency_image_small_cells_fill_routed_and_drop_the_grid():
    L, E = 2, 3
    snap = ResidencySnapshot(L, E, (RESIDENT,) * 6, (1,) * 6, (0, 1, 0, 0, 0, 0), 0)
    img = residency_rgb(snap, 3, 2)
    assert img.shape == (L * 2, E * 3, 3)
    assert (img[0:2, 3:6] == ROUTED_RGB).all()          # routed expert (0, 1): filled, not outlined
    assert not (img == GAP_RGB).all(axis=-1).any()      # no grid gap at 3 x 2 px cells


def test_heat_map_128_experts_x_48_layers_is_built_at_screen_size(qtbot):
    """Qwen3-30B-A3B's 48 x 128 map: one image item, built about 1:1 with the view (so no
    aliased grid lines), rebuilt when the panel is resized; 8 x 32 gets tall cells."""
    p = PlotPanels()
    qtbot.addWidget(p)
    p.timer.stop()
    p.resize(520, 900)
    p.show()
    qtbot.waitExposed(p)
    for L, E in ((48, 128), (32, 8)):
        p.on_loaded(Loaded("m", "/s", "int8", L, E, 8, 512, 16, 8_000_000_000, 1, 1, 1))
        n = L * E
        p.on_residency(ResidencySnapshot(L, E, (RESIDENT,) * n, tuple(range(n)), (0,) * n, 1))
        p.redraw()
        vb = p.heat_plot.getPlotItem().getViewBox()
        cw, ch = p._cell_px(L, E)
        assert p.heat_image.shape[:2] == (L * ch, E * cw)
        assert E * cw <= vb.width() * p.heat_plot.devicePixelRatioF() < E * (cw + 1)
        assert L * ch <= vb.height() * p.heat_plot.devicePixelRatioF() < L * (ch + 1)
    p.resize(1100, 1500)
    qtbot.waitUntil(lambda: p._cell_px(32, 8) != (cw, ch), timeout=1_800_000)
    p.redraw()
    assert p.heat_image.shape[:2] == (32 * p._cell_px(32, 8)[1], 8 * p._cell_px(32, 8)[0])


def test_remote_experts_have_their_own_colour_and_legend(qtbot):
    """Experts held by an expert-parallel cluster worker (REMOTE) are drawn in their own colour,
    and the legend names them once a snapshot has one (a single machine never shows it)."""
    from engine import REMOTE
    img = residency_rgb(ResidencySnapshot(1, 2, (REMOTE, ABSENT), (5, 5), (0, 0), 0))
    c = img[CELL_PX // 2, CELL_PX // 2].astype(int)
    assert np.argmax(c) == np.argmax(STATE_RGB[REMOTE]) and tuple(STATE_RGB[REMOTE]) != tuple(STATE_RGB[ABSENT])
    p = PlotPanels()
    qtbot.addWidget(p)
    p.on_residency(ResidencySnapshot(1, 2, (RESIDENT, ABSENT), (1, 1), (0, 0), 0))
    assert "on another computer" not in p.heat_legend.text()
    p.on_residency(ResidencySnapshot(1, 2, (RESIDENT, REMOTE), (1, 1), (0, 0), 1))
    assert "on another computer" in p.heat_legend.text()


def test_metrics_mark_cluster_experts_remote():
    """MetricsTracker.residency turns an absent expert that a worker holds into REMOTE; a
    cached one stays what the cache says."""
    from types import SimpleNamespace
    from engine import REMOTE
    from engine.metrics import MetricsTracker
    st = np.array([[ABSENT, RESIDENT, ABSENT]], np.int8)
    cache = SimpleNamespace(L=1, E=3, residency=lambda: st.copy(), routed_now=np.zeros((1, 3), bool),
                            stats=SimpleNamespace(snapshot=lambda: {}))
    on_worker = np.array([[True, True, False]])
    snap = MetricsTracker(cache, 1, lambda: 0, remote=lambda: on_worker).residency(0, np.zeros((1, 3)), force=True)
    assert snap.state == (REMOTE, RESIDENT, ABSENT)
    snap = MetricsTracker(cache, 1, lambda: 0).residency(0, np.zeros((1, 3)), force=True)
    assert snap.state == (ABSENT, RESIDENT, ABSENT)


def test_ssd_panel_shows_tokens_per_forward_and_drafts_kept(qtbot):
    """Speculative decoding's yield: the SSD panel's legend and the answer line say it alike."""
    from dataclasses import replace

    from engine import Finished
    from colibri_app.chat_view import format_meta
    p = PlotPanels()
    qtbot.addWidget(p)
    p.timer.stop()
    p.on_loaded(Loaded("m", "/s", "int8", 2, 4, 2, 512, 4, 8_000_000_000, 1, 1, 1))
    p.on_metrics(replace(_metrics(3), tokens_per_forward=2.5, draft_acceptance=0.75))
    p.redraw()
    assert "2.50 tokens/forward, drafts 75% kept" in p.ssd_legend.text()
    fin = Finished("stop", 10, 9, "x", (1,) * 9, 0.1, 50.0, 100.0, 1.0, 0.0, 0.0,
                   tokens_per_forward=2.0, draft_tokens=8, accepted_tokens=6)
    p.on_finished(fin)
    assert "2.00 tokens/forward, drafts 75% kept" in p.ssd_legend.text()
    assert "2.00 tokens/forward, drafts 75% kept" in format_meta({"tokens": 9, "tokens_per_forward": 2.0,
                                                                  "draft_acceptance": 0.75})
    assert "tokens/forward" not in format_meta({"tokens": 9})
