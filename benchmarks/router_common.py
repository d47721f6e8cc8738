"""Shared by the router benchmarks: policies to compare, latency figures, plots."""
from __future__ import annotations

import statistics

from lookahead_core.policy.controller import PolicyConfig
from lookahead_core.policy.cost_profile import StepCostProfile


def policies(profile_path: str, profile: StepCostProfile, max_batch: int, fixed: list[str], tpot_ms: float | None) -> dict[str, PolicyConfig]:
    slo = {"tpot_ms": tpot_ms} if tpot_ms else {}
    out = {"plain": PolicyConfig(policy="plain", max_batch=max_batch)}
    for spec in fixed:
        n, w, g = (int(x) for x in spec.split(","))
        out[f"fixed({n},{w},{g})"] = PolicyConfig(policy="fixed", fixed={"n": n, "w": w, "g": g}, max_batch=max_batch)
    out["goodput"] = PolicyConfig(policy="goodput", profile=profile_path, max_batch=max_batch, slo=slo)
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(latencies, ttfts, tpots, tokens, makespan, slo_e2e_ms, slo_tpot_ms, sizes) -> dict:
    ok = [i for i in range(len(latencies))
          if (slo_e2e_ms is None or latencies[i] * 1000 <= slo_e2e_ms) and (slo_tpot_ms is None or tpots[i] * 1000 <= slo_tpot_ms)]
    return {
        "requests": len(latencies),
        "p50_latency_s": statistics.median(latencies),
        "p95_latency_s": pct(latencies, 0.95),
        "p50_ttft_s": statistics.median(ttfts),
        "p50_tpot_ms": statistics.median(tpots) * 1000,
        "throughput_tok_s": tokens / makespan,
        "goodput_tok_s": sum(sizes[i] for i in ok) / makespan,
        "slo_attainment": len(ok) / len(latencies),
    }


def plot(results: dict, rates: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, by_rate in results.items():
        xs = [r for r in rates if r in by_rate]
        style = dict(marker="o", lw=2.5 if name == "goodput" else 1.2)
        (line,) = axes[0].plot(xs, [by_rate[r]["p50_latency_s"] for r in xs], label=f"{name} p50", **style)
        axes[0].plot(xs, [by_rate[r]["p95_latency_s"] for r in xs], ls="--", alpha=0.5, marker=".", color=line.get_color())
        axes[1].plot(xs, [by_rate[r]["throughput_tok_s"] for r in xs], label=name, **style)
        axes[2].plot(xs, [by_rate[r]["goodput_tok_s"] for r in xs], label=name, **style)
    for ax, label in zip(axes, ["request latency, s (dashed: p95)", "throughput, tokens/s", "goodput under SLO, tokens/s"]):
        ax.set_xlabel("arrival rate, requests/s")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
