"""The run report's page in Debian's headless chromium: the curves are in the DOM, laid out and drawn.

Three looks, each by the browser itself: ``--dump-dom`` (the DOM chromium parsed),
Selenium (each figure's laid-out size and line length) and ``--screenshot``
(a PNG in which the curves' blue is actually painted).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image

from clm.report.curves import training_curves
from clm.report.html import render_html
from support.browser import chromium_driver, run_chromium

HISTORY = [{"epoch": epoch, "train": {"loss": loss}, "validation": {"count": 30, "accuracy": accuracy, "nll": nll}}
           for epoch, loss, accuracy, nll in ((1, 1.3, 0.5, 0.95), (2, 0.9, 0.6, 0.74), (3, 0.7, 0.63, 0.78),
                                              (4, 0.6, 0.61, 0.83))]
CURVES = {"train_loss", "accuracy", "nll"}
CURVE_BLUE = (0x1F, 0x5F, 0xA8)  # curves.py's line colour
WIDTH, HEIGHT = 1280, 1000


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    report = {"mode": "train", "loss_mode": "sft", "before": {},
              "training": {"eval_metric": "nll", "best_epoch": 2, "best_value": 0.74, "history": HISTORY,
                           "curves": training_curves(HISTORY, 2)},
              "timings": {"loading": {"records": 120, "texts": 151, "seconds": 0.5, "records_per_s": 21025.3}}}
    path = root / "report.html"
    path.write_text(render_html(report), encoding="utf-8")
    return path


def test_the_parsed_dom_has_a_curve_figure_per_metric_with_its_points(page, tmp_path):
    dom = run_chromium(tmp_path / "profile", "--dump-dom", page.as_uri()).stdout
    figures = re.findall(r'<svg class="curve" data-curve="([^"]+)"(.*?)</svg>', dom, flags=re.S)
    assert {name for name, _ in figures} == CURVES
    for _, body in figures:
        assert body.count("<circle") == 4 and "<polyline" in body and 'class="best-epoch"' in body
    assert "21,025 records/s" in dom


def test_the_figures_are_laid_out_and_their_lines_drawn(page, tmp_path):
    with chromium_driver(tmp_path / "profile", WIDTH, HEIGHT) as driver:
        driver.get(page.as_uri())
        shapes = driver.execute_script("""
            return [...document.querySelectorAll('svg.curve')].map(svg => ({
                name: svg.dataset.curve, width: svg.getBoundingClientRect().width,
                height: svg.getBoundingClientRect().height,
                line: svg.querySelector('polyline').getTotalLength(),
                best: svg.querySelector('circle.best').getBoundingClientRect().width}));""")
        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert {shape["name"] for shape in shapes} == CURVES and not errors
    for shape in shapes:
        assert shape["width"] == 360 and shape["height"] == 210, shape
        assert shape["line"] > 100 and shape["best"] == pytest.approx(9, abs=0.5), shape


def test_a_screenshot_of_the_page_shows_the_curves(page, tmp_path):
    shot = tmp_path / "report.png"
    run_chromium(tmp_path / "profile", f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}",
                 "--hide-scrollbars", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(shot) as image:
        assert image.size == (WIDTH, HEIGHT)
        pixels = np.asarray(image.convert("RGB"), dtype=int)
    blue = int((np.abs(pixels - np.array(CURVE_BLUE)) <= 24).all(axis=-1).sum())
    assert blue > 500, f"only {blue} pixels of the curves' colour: the figures were not painted"
