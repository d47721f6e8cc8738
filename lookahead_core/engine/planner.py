"""The one owner of a step's width: each running request offers its menu, one rule picks."""
from __future__ import annotations

from collections.abc import Sequence

from lookahead_core.engine.sequence import Offer
from lookahead_core.engine.step_costs import StepCosts
from lookahead_core.lookahead.pacing import StepChoice, StepKind, batch_width


class StepPlanner:
    """Settles the batch's widest row and each row's kind from measured step costs.

    Requests that pace offer their kinds with the tokens they expect (their own running
    acceptance); requests that do not (plain, or `adapt` off) take one width, which sets a floor
    every other row rides up to for free. Costs are `StepCosts` at the batch the queue would
    fill (running + waiting, up to `max_batch`), and `slo_tpot_ms` caps the width: a step may not
    widen past what keeps its predicted time per output token within the SLO.
    """

    def __init__(self, costs: StepCosts, max_batch: int, slo_tpot_ms: float | None = None) -> None:
        self.costs = costs
        self.max_batch = max_batch
        self.slo_tpot_ms = slo_tpot_ms

    def row_price(self, requests: int) -> float:
        """The measured price of one more row per request, in one-token steps, at the batch the
        queue would fill: candidates accepted less often than this do not earn their row."""
        return self.costs.row_price(min(self.max_batch, requests))

    def plan(self, offers: Sequence[Offer], waiting: int = 0) -> list[StepChoice]:
        costs = self.costs
        batch = min(self.max_batch, len(offers) + waiting)

        def ratio(width: int) -> float:
            return costs.ratio(batch, width)

        def fits_slo(width: int, tokens_per_row: float) -> bool:
            ms = costs.estimate_ms(batch, width)
            # Only passed on when slo_tpot_ms is set.
            return ms is None or self.slo_tpot_ms is None or ms / max(tokens_per_row, 1.0) <= self.slo_tpot_ms

        floor = max((o.width for o in offers if o.menu is None), default=1)
        menus = [o.menu for o in offers if o.menu is not None]
        cap = batch_width(menus, ratio, floor, fits_slo if self.slo_tpot_ms else None) if menus else floor
        widen = len(offers) == 1  # alone: a retry may widen the step, nobody else pays for it
        return [
            o.pacer.pick(o.menu, o.copied, cap, ratio, widen) if o.menu is not None and o.pacer is not None
            else StepChoice(StepKind.PLAIN if o.width == 1 else StepKind.FULL)
            for o in offers
        ]
