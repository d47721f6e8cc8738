"""Chooses each request's (N, W, G) from the replica's queue depth.

Spend spare FLOPs on lookahead when the queue is short; give them back to batching when it is
long. Policies: `plain`, `fixed`, `queue_depth_table` (explicit bands) and `goodput` (default):
maximise predicted accepted tokens per second of the whole batch under the measured step-cost
curve, among the settings that meet the time-per-output-token SLO. The profile is only where
`goodput` starts: the engine's own forward timings (`StepCosts`) and what running requests
accept (`observe`) replace its figures as they come in.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lookahead_core.engine.step_costs import StepCosts
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
    learn_rate: float = Field(0.05, ge=0, le=1, description="weight of each new step in the online estimates (0: profile only)")
    learn_after_steps: int = Field(16, ge=1, description="request steps of a setting before its measured compression is used")

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
    """Holds the current choice; `choose(depth)` re-evaluates it with hysteresis.

    Learns online: `costs` (the runner's measured forwards) prices a step wherever its batch and
    width have run, and the profile scaled by how far measured forwards drift from it prices the
    rest; `observe` replaces a setting's compression and tokens per row with what requests
    running it got. State: one scale, and steps, compression and tokens per row per profiled setting.
    """

    def __init__(self, config: PolicyConfig, profile: StepCostProfile | None = None, base_dir: Path | None = None,
                 costs: StepCosts | None = None) -> None:
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
        self.costs = costs
        self.cost_scale = 1.0  # measured / profiled forward time
        self._seen_forwards = 0
        self._learned: dict[LookaheadParams | None, tuple[int, float, float]] = {}  # steps, compression, tokens/row

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
        tokens = self.learned(s)[1]
        return tokens + (s.max_step_tokens - tokens) * (1 - 1 / batch)

    def step_ms(self, s: Setting, batch: int) -> float:
        width = self.row_width(s, batch)
        if self.costs is not None and (ms := self.costs.measured(batch, round(width))) is not None:
            return ms
        return self.profile.step_ms(batch, width) * self.cost_scale

    def learned(self, s: Setting) -> tuple[float, float]:
        """(compression, tokens per row) of `s`: measured once requests ran it long enough."""
        steps, comp, tokens = self._learned.get(s.params, (0, s.compression, s.step_tokens))
        if steps < self.config.learn_after_steps:
            return s.compression, s.step_tokens
        return comp, tokens

    def observe(self, params: LookaheadParams | None, steps: int, tokens: int, rows: int) -> None:
        """Requests running `params` took `steps` steps, accepted `tokens` and fed `rows` rows."""
        if steps <= 0 or self.config.learn_rate == 0:
            return
        key = None if params is None else LookaheadParams(params.n, params.w, params.g)
        setting = next((s for s in self.profile.settings if s.params == key), None) if self.profile else None
        if setting is None:
            return
        seen, comp, width = self._learned.get(key, (0, setting.compression, setting.step_tokens))
        a = 1.0 - (1.0 - self.config.learn_rate) ** steps  # the same weight per step, however they are grouped
        if seen == 0:
            a = 1.0
        self._learned[key] = (seen + steps, comp + a * (tokens / steps - comp), width + a * (rows / steps - width))

    def observe_forwards(self) -> None:
        """Fold the latest measured forward into the drift of the profile's prices."""
        costs = self.costs
        if costs is None or costs.last is None or costs.observed == self._seen_forwards or self.config.learn_rate == 0:
            return
        self._seen_forwards = costs.observed
        batch, width, ms = costs.last
        ratio = ms / self.profile.step_ms(batch, width)
        self.cost_scale += self.config.learn_rate * (ratio - self.cost_scale)

    def goodput(self, s: Setting, batch: int) -> float:
        """Predicted accepted tokens per second of the whole batch."""
        return batch * self.learned(s)[0] / self.step_ms(s, batch) * 1000.0

    def tpot_ms(self, s: Setting, batch: int) -> float:
        return self.step_ms(s, batch) / self.learned(s)[0]

    def _meets_slo(self, s: Setting, batch: int) -> bool:
        target = self.config.slo.tpot_ms
        return target is None or self.tpot_ms(s, batch) <= target

    def _choose_goodput(self, depth: int) -> LookaheadParams | None:
        self.observe_forwards()
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
