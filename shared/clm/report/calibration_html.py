"""The report page's calibration section: read from the report dict's ``calibration`` (``clm.calibration.report``).

Before/after calibration on test, the reliability diagram after, each question id's rule (its certified
threshold and guarantee, or why it defers everything) with its automated share and error on test, a
risk-coverage curve per question id (inline SVG, the chosen threshold marked), and the re-split honesty check.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from clm.report.numbers import format_number

WIDTH, HEIGHT, MARGIN = 240, 150, 30


def _fmt(value: Any) -> str:
    return html.escape(format_number(value))


def _share(value: Any) -> str:
    return "–" if value is None else f"{100 * float(value):.1f}%"


def risk_coverage_svg(question_id: str, points: Sequence[Mapping[str, Any]], threshold: float | None) -> str:
    """Error among automated answers (y) against the share automated (x), one point per threshold; the
    certified threshold's point in red."""
    plotted = [p for p in points if p.get("error") is not None]
    if not plotted:
        return ""

    def x(coverage: float) -> float:
        return MARGIN + coverage * (WIDTH - 2 * MARGIN)

    def y(error: float) -> float:
        return HEIGHT - MARGIN - error * (HEIGHT - 2 * MARGIN)

    line = " ".join(f"{x(p['coverage']):.1f},{y(p['error']):.1f}" for p in plotted)
    chosen = [p for p in plotted if threshold is not None and abs(p["threshold"] - threshold) < 1e-9]
    marks = "".join(f'<circle cx="{x(p["coverage"]):.1f}" cy="{y(p["error"]):.1f}" r="4" fill="#b00020"/>'
                    for p in chosen)
    return (f'<figure><svg width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="risk-coverage, '
            f'{html.escape(question_id)}"><rect x="{MARGIN}" y="{MARGIN}" width="{WIDTH - 2 * MARGIN}" '
            f'height="{HEIGHT - 2 * MARGIN}" fill="none" stroke="#ccc"/>'
            f'<polyline points="{line}" fill="none" stroke="#1f5fa8" stroke-width="1.5"/>{marks}'
            f'<text x="{WIDTH / 2}" y="{HEIGHT - 8}" font-size="10" text-anchor="middle">share automated</text>'
            f'<text x="10" y="{HEIGHT / 2}" font-size="10" transform="rotate(-90 10 {HEIGHT / 2})" '
            f'text-anchor="middle">error</text></svg>'
            f'<figcaption>{html.escape(question_id)}</figcaption></figure>')


def calibration_section(report: Mapping[str, Any]) -> str:
    calibration = report.get("calibration")
    if not calibration:
        return ""
    split, alpha, delta = calibration.get("split", {}), calibration["alpha"], calibration["delta"]
    parts = ["<h2>Calibration: automate or defer</h2>",
             f"<p>Fitted on {_fmt(split.get('records'))} records ({html.escape(str(split.get('source')))}) that "
             f"never selected the heads. Each rule automates an answer when its calibrated confidence reaches the "
             f"threshold: with probability at least {_fmt(1 - delta)} over the calibration draw, at most "
             f"{_share(alpha)} of the automated answers of that question are wrong (certified levels: "
             f"{', '.join(_fmt(level) for level in calibration.get('certified_levels', []))}).</p>"]
    if calibration.get("temperature_scaling", "fitted") != "fitted":
        parts.append(f"<p>Temperatures {html.escape(calibration['temperature_scaling'])}.</p>")
    test = calibration.get("test")
    if test:
        before, after = test["before"]["overall"], test["after"]["overall"]
        parts.append("<table><tr><th>test</th><th>before calibration</th><th>after</th></tr>" + "".join(
            f"<tr><td>{name}</td><td>{_fmt(before.get(name))}</td><td>{_fmt(after.get(name))}</td></tr>"
            for name in ("nll", "ece", "accuracy")) + "</table>")
        parts.append(f"<p>A perfectly calibrated model would show an ECE of about {_fmt(test.get('ece_floor'))} on "
                     "these test answers (labels drawn from its own probabilities): ECE over a finite set is never "
                     "0.</p>")
        if calibration.get("diagram"):
            parts.append(f'<figure><img src="{html.escape(calibration["diagram"])}" width="360" '
                         'alt="reliability after calibration, test"></figure>')
    rows, figures = [], []
    for question_id, entry in (calibration.get("by_question") or {}).items():
        certificate = entry.get("certificate") or {}
        threshold = certificate.get("threshold")
        rows.append(f"<tr><td>{html.escape(question_id)}</td><td>{_fmt(threshold)}</td>"
                    f"<td>{html.escape(str(certificate.get('scope', '–')))}</td><td>{_fmt(certificate.get('answers'))}"
                    f"</td><td>{_share(entry['test']['automated_share'])}</td>"
                    f"<td>{_share(entry['test']['error_among_automated'])}</td>"
                    f"<td>{html.escape(str(certificate.get('reason') or ''))}</td></tr>")
        figures.append(risk_coverage_svg(question_id, entry.get("risk_coverage", []), threshold))
    if rows:
        parts.append("<table><tr><th>question</th><th>threshold</th><th>scope</th><th>calibration answers</th>"
                     "<th>automated on test</th><th>error among automated (test)</th><th>why nothing is "
                     "certified</th></tr>" + "".join(rows) + "</table>")
        parts.append(f'<div class="curves">{"".join(figures)}</div>')
    overall = calibration.get("automated_on_test")
    if overall:
        parts.append(f"<p>On test: {_share(overall['automated_share'])} of {_fmt(overall['answers'])} answers "
                     f"automated, {_share(overall['error_among_automated'])} of them wrong.</p>")
    validity = calibration.get("validity")
    if validity and validity.get("violation_rate") is not None:
        parts.append(f"<p>Honesty check: calibration and test answers pooled and re-split "
                     f"{_fmt(validity['resplits'])} times; the held-out error among automated answers exceeded "
                     f"alpha in {_share(validity['violation_rate'])} of the re-splits on average (at most "
                     f"{_share(validity['max_violation_rate'])} for one rule; the guarantee says about "
                     f"{_share(delta)}, plus the held-out half's own sampling noise).</p>")
    return "".join(parts)
