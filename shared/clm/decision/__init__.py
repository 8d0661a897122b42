"""Decision objectives: batch assembly, SFT/RL losses, InfoNCE and RLCR.

Reproduces the seeds' decision modules (names, signatures, semantics); the
maths is specified in the design's ``objectives.md``.  Typical use::

    targets = DecisionTargets.from_questions(record_ids, questions, device=device)
    batch = assemble_decision_batch(question_logits, targets)
    loss, metrics = DecisionLossConfig(mode="sft", label_smoothing=0.1).build()(batch.logits, batch.targets)
"""

from clm.decision.batch import DecisionBatch, QuestionLogits, assemble_decision_batch
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
from clm.decision.targets import DecisionTargetProtocol, DecisionTargets

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
