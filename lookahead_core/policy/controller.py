"""Chooses each request's (N, W, G) from the replica's queue depth.

Spend spare FLOPs on lookahead when the queue is short; give them back to batching when it is
long. Policies: `plain`, `fixed`, `queue_depth_table` (explicit bands) and `goodput` (default):
maximise predicted accepted tokens per second of the whole batch under the measured step-cost
curve, among the settings that meet the time-per-output-token SLO.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lookahead_core.lookahead.params import LookaheadParams
from lookahead_core.policy.cost_profile import Setting, StepCostProfile


class Spec(BaseModel):
    """(N, W, G) as written in config files; all three absent means plain decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    n: int | None = None
    w: int | None = None
    g: int | None = None

    @model_validator(mode="after")
    def _complete(self) -> Spec:
        given = [v is not None for v in (self.n, self.w, self.g)]
        if any(given) and not all(given):
            raise ValueError("give all of n, w, g, or none of them for plain decoding")
        if all(given):
            LookaheadParams(self.n, self.w, self.g)
        return self

    @property
    def params(self) -> LookaheadParams | None:
        return None if self.n is None else LookaheadParams(self.n, self.w, self.g)


class Band(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_depth: int = Field(ge=0, description="use this band while running + waiting <= max_depth")
    lookahead: Spec = Spec()


class SloTargets(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0, description="time per output token")
    e2e_ms: float | None = Field(None, gt=0)


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    policy: Literal["plain", "fixed", "queue_depth_table", "goodput"] = "goodput"
    fixed: Spec | None = None
    table: list[Band] = []
    profile: str | None = Field(None, description="step-cost profile YAML (goodput policy)")
    slo: SloTargets = SloTargets()
    max_batch: int = Field(16, ge=1, description="the engine's batch limit")
    hysteresis: float = Field(0.1, ge=0, description="relative predicted gain needed to switch")
    min_dwell_steps: int = Field(4, ge=0, description="steps a choice is kept before it may change")

    @model_validator(mode="after")
    def _policy_inputs(self) -> PolicyConfig:
        if self.policy == "fixed" and self.fixed is None:
            raise ValueError("policy 'fixed' needs `fixed: {n, w, g}`")
        if self.policy == "queue_depth_table":
            if not self.table:
                raise ValueError("policy 'queue_depth_table' needs `table` bands")
            depths = [b.max_depth for b in self.table]
            if depths != sorted(depths) or len(set(depths)) != len(depths):
                raise ValueError("table bands must have increasing max_depth")
        if self.policy == "goodput" and self.profile is None:
            raise ValueError("policy 'goodput' needs `profile` (see python -m lookahead_core.cli.profile)")
        return self


class LookaheadPolicy:
    """Holds the current choice; `choose(depth)` re-evaluates it with hysteresis."""

    def __init__(self, config: PolicyConfig, profile: StepCostProfile | None = None, base_dir: Path | None = None) -> None:
        self.config = config
        if profile is None and config.profile is not None:
            path = Path(config.profile)
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            profile = StepCostProfile.load(path)
        self.profile = profile
        self._current: Setting | None = None
        self._band: int | None = None
        self._dwell = 0
        self.switches = 0

    def choose(self, depth: int) -> LookaheadParams | None:
        cfg = self.config
        self._dwell += 1
        if cfg.policy == "plain":
            return None
        if cfg.policy == "fixed":
            return cfg.fixed.params
        if cfg.policy == "queue_depth_table":
            band = next((i for i, b in enumerate(cfg.table) if depth <= b.max_depth), len(cfg.table) - 1)
            if self._band is None or (band != self._band and self._dwell >= cfg.min_dwell_steps):
                self.switches += self._band is not None
                self._band, self._dwell = band, 0
            return cfg.table[self._band].lookahead.params
        return self._choose_goodput(depth)

    # ---- goodput ------------------------------------------------------------------------------

    def batch_for(self, depth: int) -> int:
        return min(max(depth, 1), self.config.max_batch)

    def row_width(self, s: Setting, batch: int) -> float:
        """Rows are padded to the widest in the batch: the mean width for one row, nearing the
        setting's full width as the batch grows."""
        return s.step_tokens + (s.max_step_tokens - s.step_tokens) * (1 - 1 / batch)

    def step_ms(self, s: Setting, batch: int) -> float:
        return self.profile.step_ms(batch, self.row_width(s, batch))

    def goodput(self, s: Setting, batch: int) -> float:
        """Predicted accepted tokens per second of the whole batch."""
        return batch * s.compression / self.step_ms(s, batch) * 1000.0

    def tpot_ms(self, s: Setting, batch: int) -> float:
        return self.step_ms(s, batch) / s.compression

    def _meets_slo(self, s: Setting, batch: int) -> bool:
        target = self.config.slo.tpot_ms
        return target is None or self.tpot_ms(s, batch) <= target

    def _choose_goodput(self, depth: int) -> LookaheadParams | None:
        batch = self.batch_for(depth)
        settings = self.profile.settings
        feasible = [s for s in settings if self._meets_slo(s, batch)] or settings
        best = max(feasible, key=lambda s: self.goodput(s, batch))
        cur = self._current
        if cur is None:
            self._current, self._dwell = best, 0
        elif best != cur:
            urgent = not self._meets_slo(cur, batch) and self._meets_slo(best, batch)
            gain = self.goodput(best, batch) / self.goodput(cur, batch) - 1.0
            if urgent or (gain > self.config.hysteresis and self._dwell >= self.config.min_dwell_steps):
                self._current, self._dwell = best, 0
                self.switches += 1
        return self._current.params
