"""A gate verdict as a page for the person who approves a promotion: ``render_gate_html(verdict)``.

Pass or fail first, then the sentences that say why, the checks besides non-inferiority, one table row per
(question id or pool, metric) with its oriented difference, its one-sided bound at the level it was tested
at (``family_alpha``, or Holm's) and both p-values, and the answers that flip (the first ``MAX_FLIP_ROWS``; the verdict's JSON has all).
It reads only the verdict's ``as_dict()`` (and, when a caller stored them beside it, ``candidate``, ``live``,
``evaluated_at`` and ``sources``), so a stored verdict renders the same; every text is escaped and
every number goes through ``clm.report.numbers``, as in ``clm.report.calibration_html``.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from clm.promotion.gate import GateVerdict
from clm.report.numbers import format_number, format_signed

MAX_FLIP_ROWS = 500  # a page a browser opens quickly; the JSON keeps every flip


def _fmt(value: Any) -> str:
    return html.escape(format_number(value))


def _text(value: Any) -> str:
    return html.escape("–" if value is None else str(value))


def _signed(value: Any) -> str:
    return "–" if value is None else html.escape(format_signed(float(value)))


def _verdict_line(verdict: Mapping[str, Any]) -> str:
    passed = bool(verdict.get("passed"))
    label, css = ("PASS: the candidate may replace live", "pass") if passed else \
        ("FAIL: keep the live version", "fail")
    # What a caller adds beside the gate's own keys (the versions compared, when, on what), when present.
    about = "".join(f"<tr><th>{html.escape(key)}</th><td>{_text(verdict[key])}</td></tr>"
                    for key in ("candidate", "live", "evaluated_at", "sources") if verdict.get(key) is not None)
    return f'<p class="verdict {css}">{html.escape(label)}</p>' + (f"<table>{about}</table>" if about else "")


def _list(title: str, items: list[Any], css: str = "") -> str:
    if not items:
        return ""
    body = "".join(f"<li>{_text(item)}</li>" for item in items)
    return f'<h2>{html.escape(title)}</h2><ul class="{css}">{body}</ul>'


def _overall(verdict: Mapping[str, Any]) -> str:
    overall = verdict.get("overall") or {}
    if not overall:
        return ""
    keys = ("count", "labelled", "accuracy", "nll", "ece", "rewarded", "expected_reward")
    rows = "".join(f"<tr><td>{key}</td><td>{_fmt((overall.get('live') or {}).get(key))}</td>"
                   f"<td>{_fmt((overall.get('candidate') or {}).get(key))}</td></tr>" for key in keys)
    return f"<h2>All questions</h2><table><tr><th>metric</th><th>live</th><th>candidate</th></tr>{rows}</table>"


def _checks(verdict: Mapping[str, Any]) -> str:
    rows = []
    for check in verdict.get("checks") or []:
        state = {True: ("pass", "passed"), False: ("fail", "failed"), None: ("ns", "not checked")}[check.get("passed")]
        rows.append(f"<tr><td>{_text(check.get('name'))}</td><td class=\"{state[0]}\">{state[1]}</td>"
                    f"<td>{_fmt(check.get('live'))}</td><td>{_fmt(check.get('candidate'))}</td>"
                    f"<td>{_fmt(check.get('limit'))}</td><td>{_text(check.get('detail'))}</td></tr>")
    if not rows:
        return ""
    return ("<h2>Calibration, automation, latency</h2><table><tr><th>check</th><th>result</th><th>live</th>"
            f"<th>candidate</th><th>limit</th><th>detail</th></tr>{''.join(rows)}</table>")


def _rows(verdict: Mapping[str, Any]) -> str:
    rows = []
    for group in verdict.get("rows") or []:
        ids = ", ".join(group.get("question_ids") or [])
        name = f"{group.get('name')} ({ids})" if group.get("pooled") else group.get("name")
        for test in group.get("tests") or []:
            state = ("pass", "non-inferior") if test.get("non_inferior") else ("fail", "not shown")
            level = test.get("tested_level")
            bound_label = "" if level is None else f" ({format_number(100 * (1 - level), 4)}%)"
            rows.append(
                f"<tr><td>{_text(name)}</td><td>{_fmt(group.get('questions'))}</td><td>{_fmt(group.get('records'))}"
                f"</td><td>{_text(test.get('metric'))}</td><td>{_fmt(test.get('live'))}</td>"
                f"<td>{_fmt(test.get('candidate'))}</td><td>{_signed(test.get('difference'))}</td>"
                f"<td>{_signed(test.get('lower_bound'))}{html.escape(bound_label)}</td>"
                f"<td>{_fmt(-test['margin'] if test.get('margin') is not None else None)}</td>"
                f"<td>{_fmt(test.get('p_value'))}</td><td>{_fmt(test.get('adjusted_p_value'))}</td>"
                f"<td class=\"{state[0]}\">{state[1]}</td><td>{_fmt(group.get('flips'))}</td></tr>")
    if not rows:
        return ""
    return ("<h2>Non-inferiority per question</h2><p>Difference oriented so that worse is negative (candidate − "
            "live; live − candidate for NLL). A row is non-inferior when its one-sided lower bound, at the level "
            "it was tested at (the verdict's notes say how), is above −margin.</p><table><tr><th>question</th><th>questions</th>"
            "<th>records</th><th>metric</th><th>live</th><th>candidate</th><th>difference</th>"
            "<th>lower bound</th><th>−margin</th><th>p</th><th>Holm p</th><th>result</th><th>flips</th></tr>"
            f"{''.join(rows)}</table>")


def _flips(verdict: Mapping[str, Any]) -> str:
    flips = verdict.get("flips") or []
    if not flips:
        return "<h2>Flips</h2><p>No answer changes its top option.</p>"

    def answer(flip: Mapping[str, Any], side: str) -> str:
        option_id = flip.get(f"{side}_option_id")
        index = flip.get(f"{side}_option")
        return f"{index}" if option_id is None else f"{option_id} ({index})"

    rows = []
    for flip in flips[:MAX_FLIP_ROWS]:
        gold = flip.get("gold")
        gold_text = "–" if gold is None else (f"{flip['gold_option_id']} ({gold})" if flip.get("gold_option_id")
                                              is not None else str(gold))
        outcome = ""
        if gold is not None:
            live_right, candidate_right = flip.get("live_option") == gold, flip.get("candidate_option") == gold
            outcome = "fixed" if candidate_right and not live_right else "broken" if live_right else "both wrong"
        css = {"fixed": "pass", "broken": "fail"}.get(outcome, "ns")
        rows.append(f"<tr><td>{_text(flip.get('record_id'))}</td><td>{_text(flip.get('question_id'))}</td>"
                    f"<td>{_text(answer(flip, 'live'))}</td><td>{_fmt(flip.get('live_confidence'))}</td>"
                    f"<td>{_text(answer(flip, 'candidate'))}</td><td>{_fmt(flip.get('candidate_confidence'))}</td>"
                    f"<td>{_text(gold_text)}</td><td class=\"{css}\">{_text(outcome or '–')}</td></tr>")
    more = (f"<p>{_fmt(len(flips) - MAX_FLIP_ROWS)} more flips are in the verdict's JSON.</p>"
            if len(flips) > MAX_FLIP_ROWS else "")
    return (f"<h2>Flips ({_fmt(len(flips))})</h2><table><tr><th>record</th><th>question</th><th>live answer</th>"
            "<th>live confidence</th><th>candidate answer</th><th>candidate confidence</th><th>gold</th>"
            f"<th>outcome</th></tr>{''.join(rows)}</table>{more}")


def _settings(verdict: Mapping[str, Any]) -> str:
    settings = verdict.get("settings") or {}
    config = settings.get("config") or {}
    items = [f"<li>{html.escape(key)}: {_text(value)}</li>" for key, value in settings.items() if key != "config"]
    items += [f"<li>config.{html.escape(key)}: {_text(value)}</li>" for key, value in config.items()]
    return f"<h2>Settings (to reproduce the verdict)</h2><ul>{''.join(items)}</ul>" if items else ""


def render_gate_html(verdict: GateVerdict | Mapping[str, Any]) -> str:
    """A self-contained page (no scripts, no external files) for a verdict or its ``as_dict()``."""
    data = verdict.as_dict() if isinstance(verdict, GateVerdict) else verdict
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>CLM promotion gate</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
.verdict {{ font-size: 1.4em; font-weight: bold; }}
.pass {{ color: #067d17; }} .fail {{ color: #b00020; }} .ns {{ color: #777; }}
.failures li {{ color: #b00020; }}
</style></head><body>
<h1>CLM promotion gate</h1>
{_verdict_line(data)}
{_list("Why it fails", list(data.get("failures") or []), "failures")}
{_list("Notes", list(data.get("notes") or []))}
{_overall(data)}
{_checks(data)}
{_rows(data)}
{_flips(data) if data.get("settings") else ""}
{_settings(data)}
</body></html>
"""


__all__ = ["MAX_FLIP_ROWS", "render_gate_html"]
