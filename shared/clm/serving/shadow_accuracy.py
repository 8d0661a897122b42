"""The accuracy of the live version and of its shadow candidate on the shadowed decisions, once feedback arrives
(``clm.serving.shadow`` scores them; the decision log records the live answer only).

* **Kept**: for each shadowed decision, per question, the live answer's and the candidate's option ids: the
  ``keep`` most recent decisions still waiting for feedback (the oldest forgotten first), only while the decision
  log is on.
* **Looks** (the shadow's watch loop, every ``interval_s``): the feedback received since the last look (the
  whole log: any replica may have received it; ``clm.decision_log.reader.feedback_about`` reads only the
  segments written since) names the kept decisions that have some; those are read back with
  their latest feedback (``clm.decision_log.reader.joined``: the decision's tenant only, latest item wins) and
  each question is counted once, by the first look that finds it labelled, then forgotten. A decision whose
  feedback came before its entry reached the log is looked for again at the next looks (``LOG_WAIT_S`` at most:
  a decision the log sampled out never comes).
* **Right or wrong** (``clm.decision_log.outcomes.answer_right``, the canary's rule): ``label`` feedback decides
  both answers; ``correct`` feedback is about the live answer, so the candidate's is known only when it is the
  same answer, when the live one was right (then a different one is wrong), or on a two-option question (the live
  one wrong: the other is right); otherwise it is counted as unknown, not wrong.
* **Counted** per served model and candidate version: labelled answers, right answers of each, the candidate's
  unknowns, and the discordant pairs (the live right and the candidate wrong; the live wrong and the candidate
  right), with the exact McNemar test: a two-sided binomial test of the discordant pairs against 1/2.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from clm.decision_log.ids import decision_time_ms
from clm.decision_log.outcomes import ACCURACY_KINDS, answer_right
from clm.serving.metrics import ServeMetrics
from clm.storage.base import ObjectStore

FEEDBACK_MARGIN = timedelta(minutes=1)  # a look re-reads the feedback received this long before the last one
LOG_WAIT_S = 300.0  # a decision with feedback still absent from the log this long after is given up
LIVE, CANDIDATE = "live", "candidate"  # the arms of clm_serve_shadow_right_total


@dataclass
class Accuracy:
    """Labelled answers of one (served model, candidate version) pair, both arms on the same questions."""

    labelled: int = 0
    live_right: int = 0
    candidate_right: int = 0
    candidate_unknown: int = 0  # labelled by ``correct: false`` on a question of more than two options
    live_only: int = 0  # the live answer right, the candidate's wrong
    candidate_only: int = 0  # the live answer wrong, the candidate's right

    def add(self, live: bool, candidate: bool | None) -> None:
        self.labelled += 1
        self.live_right += live
        if candidate is None:
            self.candidate_unknown += 1
            return
        self.candidate_right += candidate
        self.live_only += live and not candidate
        self.candidate_only += candidate and not live

    def mcnemar_p(self) -> float | None:
        """The exact McNemar test's two-sided p-value (a binomial test of the discordant pairs against 1/2); None
        without a discordant pair."""
        discordant = self.live_only + self.candidate_only
        if not discordant:
            return None
        from scipy.stats import binomtest  # noqa: PLC0415  (scipy: only once feedback was counted)

        return float(binomtest(self.candidate_only, discordant, 0.5).pvalue)

    def as_dict(self) -> dict[str, Any]:
        known = self.labelled - self.candidate_unknown
        p = self.mcnemar_p()
        return {"labelled": self.labelled, "live_right": self.live_right, "candidate_right": self.candidate_right,
                "candidate_unknown": self.candidate_unknown,
                "live_accuracy": None if not self.labelled else round(self.live_right / self.labelled, 4),
                "candidate_accuracy": None if not known else round(self.candidate_right / known, 4),
                "discordant": {"live_right_candidate_wrong": self.live_only,
                               "live_wrong_candidate_right": self.candidate_only},
                "mcnemar_p": None if p is None else round(p, 6)}


@dataclass
class Shadowed:
    """A shadowed decision waiting for feedback: per question index, (question id, live option id, candidate
    option id, number of options), the questions not counted yet only."""

    served: str
    candidate: str
    made: datetime
    questions: dict[int, tuple[str, str, str, int]]
    awaiting: float | None = None  # when feedback was seen (monotonic) while the decision is looked for in the log


@dataclass
class ShadowAccuracy:
    """The shadowed decisions kept for their feedback, and the accuracy counted from it."""

    keep: int
    metrics: ServeMetrics
    pending: OrderedDict[str, Shadowed] = field(default_factory=OrderedDict)  # decision id -> shadowed, oldest first
    tallies: dict[tuple[str, str], Accuracy] = field(default_factory=dict)
    feedback_since: datetime | None = None  # where the next look's feedback starts

    def add(self, decision_id: str, served: str, candidate: str, questions: Sequence[Any],
            live_tops: Sequence[int], candidate_tops: Sequence[int]) -> None:
        """Keep a shadowed decision's answers (option indices of ``questions``, which have ``option_ids``)."""
        answers = {}
        for index, (question, live, shadow) in enumerate(zip(questions, live_tops, candidate_tops)):
            options = question.option_ids
            answers[index] = (question.id, options[live], options[shadow], len(options))
        made = datetime.fromtimestamp(decision_time_ms(decision_id) / 1000, timezone.utc)
        self.pending[decision_id] = Shadowed(served, candidate, made, answers)
        while len(self.pending) > self.keep:
            self.pending.popitem(last=False)

    def status(self, served: str, candidate: str) -> dict[str, Any]:
        return self.tallies.get((served, candidate), Accuracy()).as_dict()

    async def look(self, log: ObjectStore) -> None:
        """Read the feedback since the last look, and count the kept decisions it labels (blocking reads run in a
        thread; the bookkeeping stays on the event loop, where decisions are added)."""
        if not self.pending:
            return
        started = datetime.now(timezone.utc)
        # feedback comes after its decision (another replica's clock may differ a little)
        since = min(entry.made for entry in self.pending.values()) - FEEDBACK_MARGIN
        if self.feedback_since is not None:
            since = max(since, self.feedback_since)
        ids = list(self.pending)
        items = await asyncio.to_thread(read_feedback, log, since, ids)
        self.feedback_since = started - FEEDBACK_MARGIN
        self.flag(items)
        awaiting = {decision_id: entry for decision_id, entry in self.pending.items() if entry.awaiting is not None}
        if not awaiting:
            return
        rows = await asyncio.to_thread(read_joined, log, min(entry.made for entry in awaiting.values()),
                                       list(awaiting))
        self.settle(rows, awaiting)

    def flag(self, items: Iterable[Mapping[str, Any]]) -> None:
        """Mark the kept decisions that ``items`` (feedback rows) say right or wrong about a question not counted."""
        at = time.monotonic()
        for item in items:
            entry = self.pending.get(item.get("decision_id"))
            if (entry is None or entry.awaiting is not None or item.get("kind") not in ACCURACY_KINDS
                    or all(qid != item.get("question") for qid, *_ in entry.questions.values())):
                continue
            entry.awaiting = at

    def settle(self, rows: Iterable[Mapping[str, Any]], awaiting: Mapping[str, Shadowed]) -> None:
        """Count each question of ``rows`` (``reader.joined``'s) labelled now; forget what is done."""
        found = set()
        for row in rows:
            decision_id = row.get("decision_id")
            entry = awaiting.get(decision_id)
            if entry is None:
                continue
            found.add(decision_id)
            answer = entry.questions.get(row.get("question_index"))
            if answer is None or answer[0] != row.get("question_id"):
                continue
            _, live, shadow, options = answer
            live_right = answer_right(row, live)
            if live_right is None:  # no feedback saying right or wrong (yet)
                continue
            self.count(entry.served, entry.candidate, live_right,
                       answer_right(row, shadow, given=live, options=options))
            del entry.questions[row["question_index"]]
        now = time.monotonic()
        for decision_id, entry in awaiting.items():
            if decision_id in found:
                entry.awaiting = None
            if not entry.questions or (decision_id not in found and now - entry.awaiting > LOG_WAIT_S):
                self.pending.pop(decision_id, None)

    def count(self, served: str, candidate: str, live: bool, shadow: bool | None) -> None:
        self.tallies.setdefault((served, candidate), Accuracy()).add(live, shadow)
        self.metrics.shadow_labelled.labels(served, candidate).inc()
        if live:
            self.metrics.shadow_right.labels(served, candidate, LIVE).inc()
        if shadow:
            self.metrics.shadow_right.labels(served, candidate, CANDIDATE).inc()


def read_feedback(log: ObjectStore, since: datetime, ids: Sequence[str]) -> list[dict[str, Any]]:
    """Blocking: the feedback received since ``since`` about the decisions ``ids`` (``decision_id``, ``question``,
    ``kind``), from the feedback segments written since then only."""
    from clm.decision_log import reader  # noqa: PLC0415  (pyarrow, DuckDB: only when the log is read)

    return reader.feedback_about(log, ids, since=since).select(["decision_id", "question", "kind"]).to_pylist()


def read_joined(log: ObjectStore, since: datetime, ids: Sequence[str]) -> list[dict[str, Any]]:
    """Blocking: the questions of the decisions ``ids`` made since ``since``, each with its latest feedback."""
    import pyarrow as pa  # noqa: PLC0415  (pyarrow, DuckDB: only when the log is read)
    import pyarrow.compute as pc  # noqa: PLC0415

    from clm.decision_log import reader  # noqa: PLC0415

    table = reader.joined(log, since=since)
    table = table.filter(pc.is_in(table["decision_id"], value_set=pa.array(ids, pa.string())))
    return table.select(["decision_id", "question_index", "question_id", "kind", "label", "correct"]).to_pylist()
