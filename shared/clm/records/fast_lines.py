"""A fast reader for records lines that vouches only for what the strict reader would accept identically.

``clm.records.loader.read_line`` (strict JSON, then pydantic with the
answer and reward resolvers) costs ~90 us a line: 10^6 records took
90 s to load. This reader decodes a line with msgspec into its top-level
members as raw JSON (~2 us) and vouches for the line only when every part
is proven to be what the strict reader would make of it; **any** line it
cannot vouch for, for any reason, is handed to ``read_line``, so every
refusal and every message stays the strict reader's own.

What makes a line fast, and why each step is sound:

* **Canonical top level.** msgspec keeps the last of two equal keys
  silently, so the members are re-encoded and must equal the line byte for
  byte: an encoding of a ``dict`` has no repeated key, so the line has none
  either. Lines written compactly with UTF-8 kept (``separators=(",", ":")``,
  ``ensure_ascii=False``: how ``clm_devtools.synthetic`` and msgspec write) qualify;
  other spellings are valid but read by the strict reader, at its pace.
* **Repeated parts validated once, by the strict reader.** ``questions``,
  ``answers``, ``rewards``, ``instructions`` and ``weight`` repeat across a
  data set (it asks a few question families). Each distinct raw spelling is
  parsed by ``loads_strict`` (duplicate keys, NaN, overflow) and validated by
  ``Record`` itself (a minimal record carrying that part), once; the result
  (validated questions, labels, reward vectors) is reused for every line
  that spells the part the same way. A part that fails sends its lines to
  the strict reader. This is sound because a record's validity is the
  conjunction of these parts' validity: field validators look at one field,
  and the model validator only at questions with answers, and questions
  with rewards.
* **Per-record parts decoded by msgspec**: ``id`` (a non-empty string) and
  ``state`` (a string, or an object whose re-encoding equals its raw text:
  no repeated key; msgspec refuses NaN, Infinity, overflowing numbers, lone
  surrogates and invalid UTF-8 on its own).

``tests/unit/test_records_compact.py`` checks, over generated valid and
invalid files, that loading through this reader equals loading through
``read_line`` alone: the same arrays, the same acceptance, the same errors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from clm.records.loader import read_line
from clm.records.model import Record, checked_state
from clm.records.questions import Question
from clm.records.strict_json import loads_strict
from clm.texts import render_state

REQUIRED_MEMBERS = frozenset({"id", "state", "questions"})
ALLOWED_MEMBERS = REQUIRED_MEMBERS | {"instructions", "answers", "rewards", "weight"}

_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_str = msgspec.json.Decoder(str).decode
_decode_state = msgspec.json.Decoder(str | dict).decode
_encode = msgspec.json.Encoder().encode

# A part the strict reader refused: its lines always go to the strict reader.
_REFUSED: Any = object()


class QuestionsBlock:
    """One validated ``questions`` object, shared by every line that spells it the same way.

    ``clm.records.compact`` keeps what it derives once per block (schema
    indices, option text ids) in ``compacted``.
    """

    __slots__ = ("data", "items", "compacted")

    def __init__(self, data: dict[str, Any], questions: dict[str, Question]) -> None:
        self.data = data  # the strict reader's parse, reused to validate answers and rewards against it
        self.items: tuple[tuple[str, Question], ...] = tuple(questions.items())
        self.compacted: Any = None


class RewardRows(NamedTuple):
    """A record's reward tables in ``CompactRecords``' layout: per question a flag, per option a value."""

    has_rewards: tuple[bool, ...]
    flat_rewards: tuple[float, ...]  # every question's options, NaN for a question without a reward table

    @classmethod
    def of(cls, block: QuestionsBlock, rewards: Sequence[tuple[float, ...] | None]) -> RewardRows:
        """From ``QuestionTarget.rewards`` (one per question of ``block``)."""
        flat: list[float] = []
        for (_, question), question_rewards in zip(block.items, rewards):
            flat.extend((math.nan,) * len(question.option_ids()) if question_rewards is None else question_rewards)
        return cls(tuple(r is not None for r in rewards), tuple(flat))


class VouchedLine(NamedTuple):
    """A line the fast reader vouches for: everything ``clm.records.compact`` keeps of its record."""

    id: str
    weight: float
    rendered_state: str
    instructions: str | None
    block: QuestionsBlock
    labels: tuple[int, ...]  # per question: the gold option index, or IGNORE_INDEX
    rewards: RewardRows


_NO_SUPERVISION = b""  # cache key of an absent answers or rewards member
CACHE_ENTRIES = 65_536  # per cache: a data set asks a few question families; beyond this, parts are not repeats


def _remember(cache: dict, key: Any, value: Any) -> Any:
    """``value``, kept in ``cache`` while it has room (a full cache stops growing; its entries stay valid)."""
    if len(cache) < CACHE_ENTRIES:
        cache[key] = value
    return value


class FastLineReader:
    """A line reader for ``read_records_file``: a ``VouchedLine`` when it can vouch, else ``read_line``'s answer.

    One reader per file load; its caches hold one entry per distinct spelling
    of a repeated part, at most ``CACHE_ENTRIES`` each, so data whose parts
    never repeat (options chosen per record) costs validation time, not RAM
    that grows with the file. ``strict_lines`` counts the lines handed to the strict
    reader (blank lines included), so a caller can see which path a file took.
    """

    def __init__(self) -> None:
        self.strict_lines = 0
        self._blocks: dict[bytes, QuestionsBlock] = {}
        self._labels: dict[tuple[bytes, bytes], tuple[int, ...]] = {}
        self._rewards: dict[tuple[bytes, bytes], RewardRows] = {}
        self._instructions: dict[bytes, str | None] = {}
        self._weights: dict[bytes, float] = {}

    def __call__(self, raw: bytes, source: str, line_number: int) -> VouchedLine | Record | list | None:
        try:
            vouched = self._vouch(raw)
        except ValueError:  # msgspec's errors, invalid UTF-8, ...: whatever it is, the strict reader says it
            vouched = None
        if vouched is not None:
            return vouched
        self.strict_lines += 1
        return read_line(raw, source, line_number)

    def _vouch(self, raw: bytes) -> VouchedLine | None:
        line = raw[:-1] if raw.endswith(b"\n") else raw
        if not line.startswith(b"{"):
            return None
        members = _decode_members(line)
        if _encode(members) != line or not members.keys() <= ALLOWED_MEMBERS or not REQUIRED_MEMBERS <= members.keys():
            return None
        record_id = _decode_str(members["id"])
        if not record_id:
            return None
        state_raw = members["state"]
        state = _decode_state(state_raw)
        if isinstance(state, dict):
            if _encode(state) != bytes(state_raw):
                return None
            checked_state(state)  # FieldProblem (a ValueError) for a state nested past the model's limit
        parts = self.vouch_parts(members)
        if parts is None:
            return None
        weight, instructions, block, labels, reward_rows = parts
        return VouchedLine(record_id, weight, render_state(state), instructions, block, labels, reward_rows)

    def vouch_parts(self, members: dict[str, msgspec.Raw]) -> tuple | None:
        """(weight, instructions, block, labels, reward rows) of a line's members after ``id`` and ``state``,
        or None when any of them is not what the strict reader accepts (``members`` must hold ``questions``)."""
        block_key = bytes(members["questions"])
        block = self._blocks.get(block_key)
        if block is None:
            block = _remember(self._blocks, block_key, self._validate_block(block_key))
        if block is _REFUSED:
            return None
        answers = members.get("answers")
        labels_key = (block_key, _NO_SUPERVISION if answers is None else bytes(answers))
        labels = self._labels.get(labels_key)
        if labels is None:
            labels = _remember(self._labels, labels_key, self._validate_supervision(block, "answers", labels_key[1]))
        rewards = members.get("rewards")
        rewards_key = (block_key, _NO_SUPERVISION if rewards is None else bytes(rewards))
        reward_rows = self._rewards.get(rewards_key)
        if reward_rows is None:
            reward_rows = _remember(self._rewards, rewards_key,
                                    self._validate_supervision(block, "rewards", rewards_key[1]))
        if labels is _REFUSED or reward_rows is _REFUSED:
            return None
        instructions = None if "instructions" not in members else self._cached_scalar(
            self._instructions, members["instructions"], "instructions")
        weight = 1.0 if "weight" not in members else self._cached_scalar(self._weights, members["weight"], "weight")
        if instructions is _REFUSED or weight is _REFUSED:
            return None
        return weight, instructions, block, labels, reward_rows

    # -- parts validated by the strict reader, once per distinct spelling ---------------------------------

    @staticmethod
    def _strict_record(**parts: Any) -> Record | None:
        """``Record`` validation of a minimal record carrying ``parts``; None when it refuses them."""
        try:
            return Record.model_validate({"id": "r", "state": "", **parts})
        except ValueError:  # pydantic's ValidationError is a ValueError
            return None

    @staticmethod
    def _strict_json(raw: bytes) -> Any:
        """The strict reader's parse of one part; raises ValueError for anything it refuses."""
        return loads_strict(raw.decode("utf-8"))

    def _validate_block(self, raw: bytes) -> QuestionsBlock:
        try:
            data = self._strict_json(raw)
        except ValueError:
            return _REFUSED
        record = self._strict_record(questions=data)
        return _REFUSED if record is None else QuestionsBlock(data, dict(record.questions))

    def _validate_supervision(self, block: QuestionsBlock, member: str, raw: bytes) -> Any:
        """The labels (``answers``) or ``RewardRows`` (``rewards``) of one spelling of the member, or _REFUSED."""
        parts: dict[str, Any] = {"questions": block.data}
        if raw != _NO_SUPERVISION:
            try:
                parts[member] = self._strict_json(raw)
            except ValueError:
                return _REFUSED
        record = self._strict_record(**parts)
        if record is None:
            return _REFUSED
        targets = record.decision_questions()
        if member == "answers":
            return tuple(t.label for t in targets)
        return RewardRows.of(block, [t.rewards for t in targets])

    def _cached_scalar(self, cache: dict[bytes, Any], raw: msgspec.Raw, member: str) -> Any:
        key = bytes(raw)
        found = cache.get(key, _REFUSED)
        if found is _REFUSED and key not in cache:
            found = _remember(cache, key, self._validate_scalar(key, member))
        return found

    def _validate_scalar(self, raw: bytes, member: str) -> Any:
        try:
            value = self._strict_json(raw)
        except ValueError:
            return _REFUSED
        record = self._strict_record(questions=_ONE_QUESTION, **{member: value})
        return _REFUSED if record is None else getattr(record, member)


# A question every record may carry, for validating record-level parts that do not depend on the questions.
_ONE_QUESTION = {"q": {"type": "noul"}}

__all__ = ["FastLineReader", "QuestionsBlock", "RewardRows", "VouchedLine"]
