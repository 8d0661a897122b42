"""Logged requests as SystemOne records: the record-building half of ``clm.decision_log.export``.

Each dialect's logged request (``systemone``, ``decisions``, ``rank``) becomes the record the trainer reads,
its questions rebuilt exactly as they were served, and each question's latest feedback its supervision
(the rules are ``clm.decision_log.export``'s docstring). Built from the request's JSON with ``msgspec``,
a cache of the question blocks (which repeat across requests) and the state's bytes kept as logged.
"""

from __future__ import annotations

import json
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

_BLOCK_CACHE = 65_536  # distinct question blocks kept (rank's answers make a block per request)
_NO_OPTION_LIMIT = 1 << 30
_NO_ANSWERS: dict[str, Any] = {}


class _SystemOne(msgspec.Struct):
    state: msgspec.Raw
    questions: msgspec.Raw
    instructions: Any = None


class _Decisions(msgspec.Struct):
    input: Any
    questions: msgspec.Raw


class _Rank(msgspec.Struct):
    answers: msgspec.Raw
    context: Any = ""
    question: msgspec.Raw = msgspec.Raw(b"null")


_DECODERS = {"systemone": msgspec.json.Decoder(_SystemOne), "decisions": msgspec.json.Decoder(_Decisions),
             "rank": msgspec.json.Decoder(_Rank)}
_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode


class _NotARecord(ValueError):
    """A logged request the records format cannot hold (``reason``: a SKIP_REASONS entry)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class _Block:
    """A request's questions as the records write them (``json``), and per question id the answer each
    logged option id is written as (a score's level index, else the id) and the set of option ids."""

    json: bytes
    answers: dict[str, dict[str, Any]]
    options: dict[str, frozenset[str]]
    order: tuple[str, ...]  # the question ids in request order: the order of a record's answers and rewards


def input_text(value: Any) -> str:
    """The state a ``decisions`` request is read as: its input string, or its user messages joined as
    clm-serve joins them (messages by a blank line, a message's text parts by a newline)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _NotARecord("invalid_request")
    texts = []
    for message in value:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list) and all(isinstance(part, dict) and isinstance(part.get("text"), str)
                                                for part in content):
            texts.append("\n".join(part["text"] for part in content))
        else:
            raise _NotARecord("invalid_request")
    return "\n\n".join(texts)


def choice_criteria(choices: Sequence[Any]) -> dict[str, Any]:
    """A ``decisions`` choice's options as SystemOne criteria (clm-serve's ``choice_criteria``): the value's
    text names the option, its description (or null) is its text; a string value whose text another value
    shares is named by its JSON spelling and described by its description or value."""
    from clm.texts import to_text  # noqa: PLC0415

    if not isinstance(choices, list) or not all(isinstance(choice, dict) and "value" in choice for choice in choices):
        raise _NotARecord("invalid_request")
    names = [to_text(choice["value"]) for choice in choices]
    criteria: dict[str, Any] = {}
    for name, choice in zip(names, choices):
        description = choice.get("description") or None
        if names.count(name) > 1 and isinstance(choice["value"], str):
            criteria[json.dumps(choice["value"])] = description or choice["value"]
        else:
            criteria[name] = description
    return criteria


def decisions_question(question: Any) -> tuple[str, Any, Any]:
    """(type, instructions, criteria) of the CLM question a ``decisions`` question is asked as (clm-serve's
    ``as_clm_question``): a predicate is a noul, a choice a choice over its values, a score a score over its
    levels' descriptions, else labels."""
    if not isinstance(question, dict):
        raise _NotARecord("invalid_request")
    kind, instructions = question.get("type"), question.get("instructions")
    if kind == "predicate":
        return "noul", instructions, None
    if kind == "choice":
        return "choice", instructions, choice_criteria(question.get("choices"))
    if kind == "score":
        levels = question.get("levels")
        if not isinstance(levels, list) or not all(isinstance(level, dict) for level in levels):
            raise _NotARecord("invalid_request")
        return "score", instructions, [level.get("description") or level.get("label") for level in levels]
    raise _NotARecord("invalid_request")


def record_question(qid: str, kind: Any, instructions: Any, criteria: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The question as a record writes it, and its option ids: the question clm-serve scored
    (``clm.contract.questions.build_question``), which the records' own model must accept with the same
    options and option texts (else ``_NotARecord``)."""
    from pydantic import ValidationError  # noqa: PLC0415

    from clm.contract.questions import StructuredDecisionError, build_question  # noqa: PLC0415
    from clm.texts import as_question, option_texts, to_text  # noqa: PLC0415

    if not isinstance(kind, str):
        raise _NotARecord("not_a_record")
    try:
        served = build_question(qid, kind, instructions, criteria, _NO_OPTION_LIMIT)
    except (StructuredDecisionError, ValidationError, TypeError, ValueError, RecursionError):
        raise _NotARecord("not_a_record") from None
    model = served.model
    written: dict[str, Any] = {"type": served.type.name}
    if model.instructions not in (None, ""):
        written["instructions"] = model.instructions
    if served.type.name == "choice":
        written["criteria"] = dict(model.criteria)
    elif served.type.name == "score":
        written["criteria"] = [to_text(level) for level in model.criteria]  # a level's text is its to_text
    elif model.criteria is not None:
        described = {key: value for key, value in model.criteria.as_dict().items() if value is not None}
        if described:
            written["criteria"] = described
    try:
        strict = as_question(written)
        same = strict.option_ids() == served.option_ids and option_texts(strict) == served.option_texts
    except (ValidationError, TypeError, ValueError, RecursionError):
        same = False
    if not same:
        raise _NotARecord("not_a_record")
    return written, served.option_ids


def _block(questions: list[tuple[str, Any, Any, Any]]) -> _Block:
    written: dict[str, Any] = {}
    answers: dict[str, dict[str, Any]] = {}
    options: dict[str, frozenset[str]] = {}
    for qid, kind, instructions, criteria in questions:
        if not isinstance(qid, str) or not qid or qid in written:  # a repeated name: feedback cannot tell them
            raise _NotARecord("not_a_record")
        written[qid], option_ids = record_question(qid, kind, instructions, criteria)
        answers[qid] = ({option: index for index, option in enumerate(option_ids)} if kind == "score"
                        else {option: option for option in option_ids})
        options[qid] = frozenset(option_ids)
    if not written:
        raise _NotARecord("not_a_record")
    return _Block(_encode(written), answers, options, tuple(written))


def _systemone_block(raw: bytes) -> _Block:
    questions = _decode.decode(raw)
    if not isinstance(questions, dict):
        raise _NotARecord("invalid_request")
    return _block([(qid, spec.get("type"), spec.get("instructions"), spec.get("criteria"))
                   if isinstance(spec, dict) else (qid, None, None, None) for qid, spec in questions.items()])


def _decisions_block(raw: bytes) -> _Block:
    questions = _decode.decode(raw)
    if not isinstance(questions, list):
        raise _NotARecord("invalid_request")
    named = []
    for index, question in enumerate(questions):
        kind, instructions, criteria = decisions_question(question)
        named.append((question.get("name") or str(index), kind, instructions, criteria))
    return _block(named)


def _rank_block(raw: bytes) -> _Block:
    question, answers = _decode.decode(raw)
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers):
        raise _NotARecord("invalid_request")
    return _block([("rank", "choice", question, {str(index): answer for index, answer in enumerate(answers)})])


class _RecordBuilder:
    """Each decision's line, from its logged request and its usable outcomes."""

    def __init__(self) -> None:
        from clm.texts import render_state  # noqa: PLC0415

        self.render_state = render_state
        self.blocks: dict[str, dict[bytes, _Block | str]] = {"systemone": {}, "decisions": {}, "rank": {}}
        self.skipped: Counter[str] = Counter()
        self.answers = self.rewards = 0

    def _cached(self, dialect: str, key: bytes, make: Any) -> _Block:
        blocks = self.blocks[dialect]
        block = blocks.get(key)
        if block is None:
            try:
                block = make(key)
            except _NotARecord as error:
                block = error.reason
            except (msgspec.DecodeError, ValueError, TypeError, AttributeError):
                block = "invalid_request"
            if len(blocks) >= _BLOCK_CACHE:
                blocks.clear()
            blocks[key] = block
        if isinstance(block, str):
            raise _NotARecord(block)
        return block

    def _request(self, dialect: str, request: str) -> tuple[Any, str, bytes, _Block]:
        """(the state's JSON, the rendered state, the instructions member, the question block)."""
        decoded = _DECODERS[dialect].decode(request)
        if dialect == "systemone":
            block = self._cached(dialect, bytes(decoded.questions), _systemone_block)
            instructions = decoded.instructions
            member = (b',"instructions":' + _encode(instructions)
                      if isinstance(instructions, str) and instructions else b"")
            return decoded.state, self.render_state(_decode.decode(decoded.state)), member, block
        if dialect == "decisions":
            block = self._cached(dialect, bytes(decoded.questions), _decisions_block)
            text = input_text(decoded.input)
            return _encode(text), self.render_state(text), b"", block
        block = self._cached(dialect, b"[" + bytes(decoded.question) + b"," + bytes(decoded.answers) + b"]",
                             _rank_block)
        context = decoded.context or ""  # clm-serve asks a falsy context as the empty state
        return _encode(context), self.render_state(context), b"", block

    def build(self, decision_id: str, dialect: str, request: str, answered: str | None, tables: list | None,
              skips: list[str] | None) -> tuple[str, bytes] | None:
        """(rendered state, line) of one decision, or None; what was left out is counted in ``skipped``."""
        if skips is not None:
            self.skipped.update(skips)
        if answered is None and tables is None:
            return None
        try:
            state_json, state_text, instructions, block = self._request(dialect, request)
        except _NotARecord as error:
            self.skipped[error.reason] += 1
            return None
        except (msgspec.DecodeError, KeyError, ValueError, TypeError, RecursionError):
            self.skipped["invalid_request"] += 1
            return None
        answers: dict[str, Any] = {}
        rewards: dict[str, dict[str, float]] = {}
        if answered is not None:
            for qid, option in _decode.decode(answered):
                answer = block.answers.get(qid, _NO_ANSWERS).get(option)
                if answer is None:
                    self.skipped["options_mismatch"] += 1
                else:
                    answers[qid] = answer
            if len(answers) > 1:  # the SQL's lists are in no order: the request's, so a line is always the same
                answers = {qid: answers[qid] for qid in block.order if qid in answers}
        if tables is not None:
            for item in tables:
                qid, table = item["question"], dict(item["rewards"])
                if table.keys() != block.options.get(qid):
                    self.skipped["options_mismatch"] += 1
                else:
                    rewards[qid] = table
            if len(rewards) > 1:
                rewards = {qid: rewards[qid] for qid in block.order if qid in rewards}
        if not answers and not rewards:
            return None
        self.answers += len(answers)
        self.rewards += len(rewards)
        line = (b'{"id":' + _encode(decision_id) + b',"state":' + state_json + instructions + b',"questions":'
                + block.json + b',"answers":' + _encode(answers)
                + (b',"rewards":' + _encode(rewards) if rewards else b"") + b"}")
        return state_text, line


@dataclass
class Built:
    """The records of one batch of judged decisions, and what was left out."""

    times: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    states: list[str] = field(default_factory=list)
    lines: list[bytes] = field(default_factory=list)
    decisions: int = 0  # with feedback
    answers: int = 0
    rewards: int = 0
    skipped: Counter[str] = field(default_factory=Counter)


_builder: _RecordBuilder | None = None  # one per process: its question blocks are reused by every batch


def build_batch(batch: Any) -> Built:
    """Build a pyarrow batch of ``_JUDGED`` rows (in this process, or in a worker)."""
    global _builder
    if _builder is None:
        _builder = _RecordBuilder()
    builder, built = _builder, Built()
    builder.skipped, builder.answers, builder.rewards = built.skipped, 0, 0
    columns = {name: batch.column(name).to_pylist() for name in batch.schema.names}
    build = builder.build
    for decision_id, time_us, dialect, request, answered, tables, skips in zip(
            columns["decision_id"], columns["time_us"], columns["dialect"], columns["request"], columns["answered"],
            columns["tables"], columns["skips"]):
        made = build(decision_id, dialect, request, answered, tables, skips)
        if made is not None:
            built.times.append(time_us)
            built.ids.append(decision_id)
            built.states.append(made[0])
            built.lines.append(made[1])
    built.decisions, built.answers, built.rewards = batch.num_rows, builder.answers, builder.rewards
    return built


def prefetched(reader: Any, depth: int = 2) -> Any:
    """The batches of ``reader``, read ahead by a thread: DuckDB computes the next batch while this one is built
    (reading releases the GIL). The thread is done when the generator is."""
    batches: queue.Queue = queue.Queue(maxsize=depth)
    stop, end = threading.Event(), object()

    def hand(item: Any) -> bool:
        while not stop.is_set():
            try:
                batches.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def pull() -> None:
        try:
            for batch in reader:
                if not hand(batch):
                    return
            hand(end)
        except BaseException as error:  # noqa: BLE001  (raised again in the consumer)
            hand(error)

    thread = threading.Thread(target=pull, name="clm-log-export-read", daemon=True)
    thread.start()
    try:
        while (item := batches.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def time_order(times: list[int], ids: list[str]) -> list[int]:
    """Indices of the records in (time, decision_id) order."""
    import numpy as np  # noqa: PLC0415

    moments = np.asarray(times, dtype=np.int64)
    order = np.argsort(moments, kind="stable").tolist()
    ordered = moments[order]
    ties = np.flatnonzero(ordered[1:] == ordered[:-1]).tolist()  # k: the k-th and (k+1)-th records tie
    if ties:  # decided in the same microsecond: by decision id
        start = previous = ties[0]
        for index in (*ties[1:], None):
            if index is not None and index == previous + 1:
                previous = index
                continue
            order[start:previous + 2] = sorted(order[start:previous + 2], key=ids.__getitem__)
            if index is not None:
                start = previous = index
    return order
