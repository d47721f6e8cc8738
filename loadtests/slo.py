"""SLO thresholds per locust entry, and the verdict over a run's statistics."""
from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

ENTRIES = ("ttft", "tpot", "e2e", "output_tokens_per_s")
PERCENTILES = (0.5, 0.9, 0.95, 0.99)


class EntrySlo(BaseModel):
    """Upper bounds in ms on percentiles (p50..p99); for rates, lower bounds with min_*."""

    model_config = ConfigDict(extra="forbid")
    p50: float | None = Field(None, gt=0)
    p90: float | None = Field(None, gt=0)
    p95: float | None = Field(None, gt=0)
    p99: float | None = Field(None, gt=0)
    min_p50: float | None = Field(None, gt=0)


class SloConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_error_rate: float = Field(0.01, ge=0, le=1)
    min_requests: int = Field(1, ge=0, description="fewer completed requests than this is a breach")
    entries: dict[str, EntrySlo] = {}

    @classmethod
    def load(cls, path: str | Path) -> SloConfig:
        cfg = cls.model_validate(yaml.safe_load(Path(path).read_text()) or {})
        unknown = set(cfg.entries) - set(ENTRIES)
        if unknown:
            raise ValueError(f"unknown SLO entries {sorted(unknown)}; known: {', '.join(ENTRIES)}")
        return cfg


def verdict(cfg: SloConfig, figures: dict[str, dict[str, float]], requests: int, error_rate: float) -> list[str]:
    """Breaches, one line each; `figures[entry]` maps "p50".. "p99" to the measured value."""
    breaches = []
    if error_rate > cfg.max_error_rate:
        breaches.append(f"error rate {error_rate:.2%} > {cfg.max_error_rate:.2%}")
    if requests < cfg.min_requests:
        breaches.append(f"{requests} completed requests < {cfg.min_requests}")
    for entry, slo in cfg.entries.items():
        got = figures.get(entry)
        if not got:
            breaches.append(f"{entry}: no measurements")
            continue
        for key in ("p50", "p90", "p95", "p99"):
            limit = getattr(slo, key)
            if limit is not None and got[key] > limit:
                breaches.append(f"{entry} {key} {got[key]:.1f} > {limit:g}")
        if slo.min_p50 is not None and got["p50"] < slo.min_p50:
            breaches.append(f"{entry} p50 {got['p50']:.1f} < {slo.min_p50:g}")
    return breaches


def table(cfg: SloConfig, figures: dict[str, dict[str, float]]) -> str:
    lines = [f"{'entry':<22}{'count':>7}" + "".join(f"{'p' + str(int(q * 100)):>10}" for q in PERCENTILES) + "   SLO"]
    for entry in ENTRIES:
        got = figures.get(entry)
        if not got:
            continue
        slo = cfg.entries.get(entry)
        bounds = {} if slo is None else slo.model_dump()
        limits = ", ".join(f"{k}{'>=' if k.startswith('min') else '<='}{v:g}" for k, v in bounds.items() if v is not None)
        cells = "".join(f"{got['p' + str(int(q * 100))]:>10.1f}" for q in PERCENTILES)
        lines.append(f"{entry:<22}{int(got['count']):>7}" + cells + f"   {limits}")
    return "\n".join(lines)
