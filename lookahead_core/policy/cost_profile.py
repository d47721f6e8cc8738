"""A measured step-cost profile: forward latency against batch and tokens per row, and the
compression of candidate (N, W, G) settings. Measured by `python -m lookahead_core.cli.profile`."""
from __future__ import annotations

import bisect
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from lookahead_core.lookahead.params import LookaheadParams


class Setting(BaseModel):
    """A lookahead setting and what it was measured to give; n = None is plain decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    n: int | None = None
    w: int = 0
    g: int = 0
    compression: float = Field(1.0, gt=0)
    step_tokens: float = Field(1.0, ge=1, description="mean tokens per row of a step (window + candidates found)")

    @property
    def params(self) -> LookaheadParams | None:
        return None if self.n is None else LookaheadParams(self.n, self.w, self.g)

    @property
    def max_step_tokens(self) -> int:
        return 1 if self.n is None else self.params.max_step_tokens

    @property
    def label(self) -> str:
        return "plain" if self.n is None else f"({self.n},{self.w},{self.g})"


class StepCostProfile(BaseModel):
    """latency_ms[i][j]: one decode forward of batch batch_sizes[i], every row tokens[j] wide."""

    model_config = ConfigDict(extra="forbid")
    model: str
    device: str
    dtype: str = "float32"
    machine: str = ""
    shared_pool_cap: int = Field(0, ge=0, description="the engine's shared pool the compression was measured with (0: none)")
    batch_sizes: list[int]
    tokens: list[int]
    latency_ms: list[list[float]]
    settings: list[Setting]
    _cost: list[list[float]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _shape(self) -> StepCostProfile:
        if sorted(self.batch_sizes) != self.batch_sizes or sorted(self.tokens) != self.tokens:
            raise ValueError("batch_sizes and tokens must be increasing")
        if len(self.latency_ms) != len(self.batch_sizes) or any(len(r) != len(self.tokens) for r in self.latency_ms):
            raise ValueError("latency_ms must be len(batch_sizes) rows of len(tokens) values")
        if not any(s.n is None for s in self.settings):
            raise ValueError("settings must include plain decoding (n: null)")
        self._cost = self._monotone(self.latency_ms)
        return self

    @staticmethod
    def _monotone(lat: list[list[float]]) -> list[list[float]]:
        """Each cell lowered to the cheapest cell with at least its batch and tokens. Timing noise
        only adds time, so a cell dearer than a bigger step is noise, and left in it would tell the
        router that a small batch of plain steps costs more than it does."""
        rows, cols = len(lat), len(lat[0])
        cost = [row[:] for row in lat]
        for i in reversed(range(rows)):
            for j in reversed(range(cols)):
                if i + 1 < rows:
                    cost[i][j] = min(cost[i][j], cost[i + 1][j])
                if j + 1 < cols:
                    cost[i][j] = min(cost[i][j], cost[i][j + 1])
        return cost

    @classmethod
    def load(cls, path: str | Path) -> StepCostProfile:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(yaml.safe_dump(self.model_dump(), sort_keys=False))

    def pool_mismatch(self, engine_shared_pool_cap: int) -> str | None:
        """A warning if the engine runs with(out) the shared pool this profile's compression was
        measured without (with): the router would then misjudge what lookahead gains."""
        if (self.shared_pool_cap > 0) == (engine_shared_pool_cap > 0):
            return None
        return (
            f"profile of {self.model} measured compression with shared_pool_cap={self.shared_pool_cap}, but the engine "
            f"runs with shared_pool_cap={engine_shared_pool_cap}; re-run python -m lookahead_core.cli.profile "
            f"--shared-pool-cap {engine_shared_pool_cap}"
        )

    def step_ms(self, batch: int, tokens: float) -> float:
        """Bilinear interpolation in (batch, tokens) over the monotone grid, linear extrapolation
        beyond it."""

        def bracket(axis: list[int], x: float) -> tuple[int, int, float]:
            if len(axis) == 1:
                return 0, 0, 0.0
            i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
            return i, i + 1, (x - axis[i]) / (axis[i + 1] - axis[i])

        i0, i1, fb = bracket(self.batch_sizes, batch)
        j0, j1, ft = bracket(self.tokens, tokens)
        lat = self._cost
        low = lat[i0][j0] + ft * (lat[i0][j1] - lat[i0][j0])
        high = lat[i1][j0] + ft * (lat[i1][j1] - lat[i1][j0])
        return max(low + fb * (high - low), 1e-3)


