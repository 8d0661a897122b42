"""Decision objectives: batch assembly, SFT/RL losses, InfoNCE and RLCR.

NeMo AutoModel's documented API, name for name: :mod:`clm.decision.loss` is
``components.loss.decision`` and :mod:`clm.decision.batch` is
``components.loss.decision_batch``; the package re-exports their public
names.  The maths is in ``docs/objectives.md``.  Typical use::

    targets = DecisionTargets.from_questions(record_ids, questions, device=device)
    batch = assemble_decision_batch(question_logits, targets)
    loss, metrics = DecisionLoss(DecisionLossConfig())(batch.logits, batch.targets)
"""

from clm.decision.batch import DecisionBatch, DecisionTargetProtocol, DecisionTargets, QuestionLogits, assemble_decision_batch
from clm.decision.config import DecisionLossConfig
from clm.decision.constants import CHOICE_TYPE, IGNORE_INDEX, NOUL_TYPE, QUESTION_TYPE_IDS, SCORE_TYPE
from clm.decision.errors import (
    DecisionBatchError,
    DecisionError,
    DecisionLossConfigError,
    DecisionLossInputError,
    DecisionTargetsError,
)
from clm.decision.infonce import group_masked_bidirectional_infonce
from clm.decision.loss import DecisionLoss
from clm.decision.masking import masked_log_softmax
from clm.decision.rlcr import RLCRLossOutput, rlcr_loss

__all__ = [
    "CHOICE_TYPE",
    "IGNORE_INDEX",
    "NOUL_TYPE",
    "QUESTION_TYPE_IDS",
    "SCORE_TYPE",
    "DecisionBatch",
    "DecisionBatchError",
    "DecisionError",
    "DecisionLoss",
    "DecisionLossConfig",
    "DecisionLossConfigError",
    "DecisionLossInputError",
    "DecisionTargetProtocol",
    "DecisionTargets",
    "DecisionTargetsError",
    "QuestionLogits",
    "RLCRLossOutput",
    "assemble_decision_batch",
    "group_masked_bidirectional_infonce",
    "masked_log_softmax",
    "rlcr_loss",
]
