"""The recipe's ``calibration:`` section: how temperatures are fitted and thresholds certified.

One frozen pydantic model that forbids unknown keys, so a typo (``calibration.alpah``) fails before any work
starts and every error names its key, as every other recipe section does. The defaults are the documented
ones: certify an error of at most 10% among automated answers with 90% confidence, and also at 5% and 1% so a
request may ask for a stricter level than the configured one.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


DEFAULT_STRICTER_ALPHAS = (0.05, 0.01)


class CalibrationConfig(BaseModel):
    """Temperature scaling per question id, shrunk toward its pool, and a certified automate-or-defer threshold
    per question id (Learn-then-Test, exact binomial tests, fixed-sequence over a threshold grid)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="fit and store calibration.json beside the heads")
    validation_share: float = Field(
        0.3, gt=0.0, lt=1.0,
        description="share of the validation records held out for calibration when the data has no separate "
                    "calibration file (held out whole records, so none of them also selects the epoch)")
    alpha: float = Field(
        0.1, gt=0.0, lt=1.0, description="the certified bound on the error rate among automated answers")
    stricter_alphas: list[float] | None = Field(
        None,
        description="further levels certified beside alpha, each in (0, alpha): a request may ask for a "
                    "stricter alpha and gets the largest certified level at or below it (null: those of "
                    "0.05 and 0.01 below alpha)")
    delta: float = Field(
        0.1, gt=0.0, lt=1.0,
        description="the certificate may be wrong with probability at most delta (over the calibration draw)")
    shrinkage_answers: int = Field(
        50, ge=0,
        description="k of the shrinkage weight n/(n+k): a question id's log temperature is blended with its "
                    "pool's, so a question id with few answers keeps close to its pool")
    min_answers: int = Field(
        100, ge=1,
        description="a question id with fewer labelled calibration answers uses its pool's threshold (a certificate "
                    "on fewer answers rarely certifies anything: about 40 must be right with none wrong at "
                    "alpha = delta = 0.1 before the first threshold can pass)")
    grid_step: float = Field(
        0.01, gt=0.0, le=0.5, description="the threshold grid: 0, step, 2 step, ... below 1")
    cost_error: float | None = Field(
        None, ge=0.0,
        description="cost of one wrong automated answer; with cost_defer, the certified threshold of the lowest "
                    "expected cost per answer is chosen instead of the lowest certified one")
    cost_defer: float | None = Field(None, ge=0.0, description="cost of one deferred answer (see cost_error)")

    @field_validator("stricter_alphas")
    @classmethod
    def _stricter(cls, values: list[float] | None, info: ValidationInfo) -> list[float] | None:
        if values is None:
            return None
        alpha = info.data.get("alpha")  # absent when alpha itself failed: that error is reported already
        for value in values:
            if not 0.0 < value < (alpha if alpha is not None else 1.0):
                raise ValueError(f"each stricter alpha must be in (0, alpha={alpha}), got {value}")
        if len(set(values)) != len(values):
            raise ValueError(f"stricter alphas must be distinct, got {values}")
        return values

    @model_validator(mode="after")
    def _costs_together(self) -> CalibrationConfig:
        if (self.cost_error is None) != (self.cost_defer is None):
            raise ValueError("cost_error and cost_defer: give both or neither "
                             f"(got cost_error={self.cost_error}, cost_defer={self.cost_defer})")
        return self

    @property
    def alphas(self) -> list[float]:
        """Every certified level, the configured one first."""
        stricter = self.stricter_alphas if self.stricter_alphas is not None else \
            [level for level in DEFAULT_STRICTER_ALPHAS if level < self.alpha]
        return [self.alpha, *stricter]
