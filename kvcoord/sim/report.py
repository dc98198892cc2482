"""Summaries of simulation results: the comparison table, its JSON form, and an optional PNG plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvcoord.sim.cluster import PolicyResult

WALL_CLOCK_KEYS = ("overhead_us_mean", "overhead_us_p99", "wall_s")
"""Summary keys measured on the host (not modelled): excluded from determinism comparisons."""


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _ratio_max_mean(xs: Sequence[float]) -> float:
    mean = sum(xs) / len(xs) if xs else 0.0
    return max(xs) / mean if mean > 0 else 1.0


def summarize(r: PolicyResult) -> dict[str, Any]:
    """The per-policy row: modelled metrics (deterministic) plus measured routing overhead."""
    return {
        "policy": r.policy,
        "requests": r.requests,
        "prompt_tokens": r.prompt_tokens,
        "hit_tokens": r.hit_tokens,
        "token_hit_rate": round(r.hit_rate, 6),
        "prefill_tokens": r.prefill_tokens,
        "ttft_p50_s": round(percentile(r.ttft, 50), 6),
        "ttft_p99_s": round(percentile(r.ttft, 99), 6),
        "ttft_mean_s": round(sum(r.ttft) / len(r.ttft), 6) if r.ttft else 0.0,
        "completion_p50_s": round(percentile(r.completion, 50), 6),
        "completion_p99_s": round(percentile(r.completion, 99), 6),
        "load_imbalance": round(_ratio_max_mean(r.node_mean_in_system), 6),
        "request_imbalance": round(_ratio_max_mean([float(x) for x in r.node_requests]), 6),
        "node_requests": r.node_requests,
        "node_prefill_tokens": r.node_prefill_tokens,
        "node_mean_in_system": [round(x, 6) for x in r.node_mean_in_system],
        "makespan_s": round(r.makespan, 6),
        "overhead_us_mean": round(sum(r.overhead_us) / len(r.overhead_us), 2) if r.overhead_us else 0.0,
        "overhead_us_p99": round(percentile(r.overhead_us, 99), 2),
        "sample_decisions": r.sample_decisions,
        **{f"hit_tokens_{where}": n for where, n in r.tier_hit_tokens.items()},
        **r.pd,
    }


def average_seeds(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row for runs of the same policy with different seeds: numbers averaged (integers rounded),
    per-node lists and decisions from the first run, the seeds and the hit rate's range added.

    Ties between equal nodes are broken by each policy's seeded random source, and where the first
    requests land changes which caches later evictions hit, so on a real trace one seed's hit rate
    can move by a few tenths of a point; ``--seeds N`` shows that spread."""
    if not rows:
        raise ValueError("no runs to average")
    out: dict[str, Any] = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        mean = sum(float(r[key]) for r in rows) / len(rows)
        out[key] = round(mean) if isinstance(value, int) else round(mean, 6)
    out["seeds"] = [r.get("seed") for r in rows]
    for key in RANGED_KEYS:
        values = [float(r[key]) for r in rows]
        out[f"{key}_min"] = min(values)
        out[f"{key}_max"] = max(values)
    out.pop("seed", None)
    return out


RANGED_KEYS = ("token_hit_rate", "ttft_p50_s", "ttft_p99_s", "load_imbalance", "overhead_us_mean")
"""Keys whose min and max across seeds a seed-averaged row keeps (the plot's error bars)."""


def deterministic_view(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without the wall-clock columns: equal across runs with the same seed."""
    return [{k: v for k, v in row.items() if k not in WALL_CLOCK_KEYS} for row in rows]


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "{}"),
    ("token_hit_rate", "hit rate", "{:.1%}"),
    ("prefill_tokens", "prefill tokens", "{:,}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
    ("load_imbalance", "imbalance", "{:.3f}"),
    ("overhead_us_mean", "route us", "{:.0f}"),
)


_PD_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("remote_prefills", "remote prefills", "{:,}"),
    ("skipped_prefills", "skipped remote prefills", "{:,}"),
    ("transferred_blocks", "blocks moved P->D", "{:,}"),
)
"""Added after the prefill tokens in a P/D run (``--prefill-nodes``)."""


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width text table (also valid Markdown); with several seeds, means and the hit range."""
    columns = list(_COLUMNS)
    if rows and "remote_prefills" in rows[0]:
        columns[3:3] = _PD_COLUMNS
    cells = [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    heads = [head for _, head, _ in columns]
    if rows and len(rows[0].get("seeds", ())) > 1:
        heads[1] = f"hit rate (mean of {len(rows[0]['seeds'])} seeds)"
        heads.insert(2, "hit min-max")
        for row, c in zip(rows, cells, strict=True):
            c.insert(2, f"{row['token_hit_rate_min']:.1%}-{row['token_hit_rate_max']:.1%}")
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]

    def line(values: Sequence[str]) -> str:
        pairs = enumerate(zip(values, widths, strict=True))
        parts = [v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in pairs]
        return "| " + " | ".join(parts) + " |"

    sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(heads), sep, *(line(c) for c in cells)])


_SOURCES = (("gpu", "GPU hits"), ("cpu", "CPU tier (evicted from GPU)"), ("pool", "pool"),
            ("pull", "pulled from peers"))


def breakdown(rows: Sequence[dict[str, Any]]) -> str:
    """Where each policy's saved prefill tokens came from (GPU, CPU tier, pool, peer pulls), and why the
    index-backed policy beats the router's own memory: the table plus one line per comparison."""
    rows = [r for r in rows if "hit_tokens_gpu" in r]
    if not rows:
        return ""
    lines = ["| policy | saved tokens | " + " | ".join(h for _, h in _SOURCES) + " |",
             "|---|---:|" + "---:|" * len(_SOURCES)]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['hit_tokens']:,} | "
                     + " | ".join(f"{r[f'hit_tokens_{k}']:,}" for k, _ in _SOURCES) + " |")
    by = {r["policy"]: r for r in rows}
    index, memory = by.get("prefix-aware"), by.get("approximate")
    if index is not None and memory is not None and memory["hit_tokens"] > 0:
        more = index["hit_tokens"] / memory["hit_tokens"] - 1
        why = ", ".join(f"{index[f'hit_tokens_{k}'] - memory[f'hit_tokens_{k}']:+,} {h}" for k, h in _SOURCES)
        lines.append(f"\nprefix-aware (index) saves {more:+.1%} prefill tokens vs approximate (router "
                     "memory): "
                     f"{why}; the index sees CPU-tier and pool residency, evictions and peers, the router's "
                     "memory sees only what it sent where.")
    return "\n".join(lines)


def check_plotting() -> None:
    """Raise ``ValueError`` naming the fix when matplotlib (the ``plot`` extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvcoord[plot]'") from None


def _spread(rows: Sequence[dict[str, Any]], key: str, scale: float = 1.0) -> list[list[float]] | None:
    """Error bars from a seed-averaged row's min and max of ``key`` (None for single-seed rows)."""
    if not all(f"{key}_min" in r for r in rows):
        return None
    return [[scale * (float(r[key]) - float(r[f"{key}_min"])) for r in rows],
            [scale * (float(r[f"{key}_max"]) - float(r[key])) for r in rows]]


def plot(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Four bar charts (hit rate, TTFT p50/p99, load imbalance, routing overhead) in one PNG; with several
    seeds, bars are means and whiskers the min-max range across seeds."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [str(r["policy"]) for r in rows]
    xs = list(range(len(names)))
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    bars = {"capsize": 4, "ecolor": "black"}
    ax = axes[0]
    ax.bar(xs, [100 * float(r["token_hit_rate"]) for r in rows], color="tab:green",
           yerr=_spread(rows, "token_hit_rate", 100.0), error_kw=bars)
    ax.set_title("token hit rate (%)")
    ax = axes[1]
    w = 0.38
    ax.bar([x - w / 2 for x in xs], [float(r["ttft_p50_s"]) for r in rows], w, label="p50",
           yerr=_spread(rows, "ttft_p50_s"), error_kw=bars)
    ax.bar([x + w / 2 for x in xs], [float(r["ttft_p99_s"]) for r in rows], w, label="p99",
           yerr=_spread(rows, "ttft_p99_s"), error_kw=bars)
    ax.set_title("TTFT (s, modelled)")
    ax.legend()
    ax = axes[2]
    ax.bar(xs, [float(r["load_imbalance"]) for r in rows], color="tab:orange",
           yerr=_spread(rows, "load_imbalance"), error_kw=bars)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title("load imbalance (max/mean in flight)")
    ax = axes[3]
    ax.bar(xs, [float(r["overhead_us_mean"]) for r in rows], color="tab:purple",
           yerr=_spread(rows, "overhead_us_mean"), error_kw=bars)
    ax.set_title("routing overhead (µs/request, measured)")
    for ax in axes:
        ax.set_xticks(xs)
        ax.set_xticklabels(names, rotation=30, ha="right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
