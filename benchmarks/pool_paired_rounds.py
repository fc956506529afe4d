"""Pool the paired rounds of several interleaved ``bench_engine_throughput.py`` runs.

A run with ``--interleave`` gives every engine a round next to each round of the baseline, so
``on`` round r over ``stock`` round r cancels the machine's drift over minutes; single runs of
6-14 rounds still cannot resolve a few percent on the lent H200. This script takes the runs'
JSON files, forms every pair (config / baseline, same batch size, same round index), and
reports per batch size the number of pairs, their median with a 95% bootstrap interval (4000
resamples, fixed seed) and their geometric mean.

The interval resamples whole *clusters*, not pairs: the pairs of one set of engine processes
(a run, or a generation of ``--generations``) share much of those processes' speeds, drawn at
their start (on the H200 two engines of the same code differed by ~7-10% in every round of one
run, and not in the next), so they are not independent; resampling pairs gave intervals far
too narrow.
With few clusters the interval is wide, which is the point::

    python benchmarks/pool_paired_rounds.py docs/results/engine_throughput_h200_*.json \\
        --baseline stock --out bench_out/pooled.json --png bench_out/pooled.png

Files without the baseline or a config, or where either did not run interleaved (the
``interleaved`` flag of each engine's result), are skipped for that config. Reports of
``bench_http_throughput.py`` pool the same way, each concurrency as a batch size (its modes
alternate round by round on one server)::

    python benchmarks/pool_paired_rounds.py docs/results/http_throughput_h200_*.json \\
        --baseline off --configs compact,json

``--png`` plots the medians with their intervals against batch size (needs matplotlib).
``--metric median_step_tokens_per_s`` pairs the rounds' throughput at their median engine step
instead of their tokens / wall time (``bench_engine_throughput.py``: ``median_step_seconds``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BOOTSTRAP_RESAMPLES = 4000


def paired_log_ratios(report: dict[str, Any], config: str, baseline: str,
                      metric: str = "tokens_per_s") -> dict[str, list[list[float]]]:
    """``{B: [[log(config round r / baseline round r), ...] per generation]}`` of one run's
    JSON report (one generation where its rounds carry no ``generation``), of each round's
    ``metric``; a batch size whose rounds lack it (older runs) has no pairs."""
    results = report.get("results", {})
    if config not in results or baseline not in results:
        return {}
    if not (results[config].get("interleaved") and results[baseline].get("interleaved")):
        return {}  # rounds of engines run one after the other are not pairs
    pairs: dict[str, list[list[float]]] = {}
    for batch, ours in results[config]["by_batch"].items():
        theirs = results[baseline]["by_batch"].get(batch)
        if theirs is None:
            continue
        if any(metric not in r for r in ours["rounds"] + theirs["rounds"]):
            continue
        clusters: dict[int, list[float]] = {}
        for a, b in zip(ours["rounds"], theirs["rounds"]):
            if a.get("generation", 0) != b.get("generation", 0):
                raise ValueError(f"{config} and {baseline} rounds of B={batch} are not aligned")
            clusters.setdefault(a.get("generation", 0), []).append(
                math.log(a[metric] / b[metric]))
        pairs[batch] = list(clusters.values())
    return pairs


def engine_shaped(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` as ``paired_log_ratios`` reads it: a ``bench_http_throughput.py`` report
    (``results[concurrency][mode]["rounds"]``, told by its ``server_command``) becomes one
    interleaved result per mode with a "batch size" per concurrency; others are returned as is."""
    if "server_command" not in report:
        return report
    results: dict[str, Any] = {}
    for concurrency, modes in report["results"].items():
        for mode, result in modes.items():
            results.setdefault(mode, {"interleaved": True, "by_batch": {}})["by_batch"][
                concurrency] = {"rounds": result["rounds"]}
    return {"results": results}


def variance_parts(clusters: list[list[float]]) -> tuple[float, float] | None:
    """``(round variance, process variance)`` of the log ratios, a one-way random-effects
    split by moments: the round part is the mean within-cluster variance (clusters of >= 2
    pairs), the process part the variance of the cluster means less the round part over the
    mean cluster size (negative where the means spread less than round noise predicts). None
    with fewer than two clusters or no cluster of two pairs."""
    within = [statistics.variance(c) for c in clusters if len(c) > 1]
    if len(clusters) < 2 or not within:
        return None
    rounds = statistics.fmean(within)
    size = statistics.fmean(len(c) for c in clusters)
    return rounds, statistics.variance(map(statistics.fmean, clusters)) - rounds / size


def summarize(clusters: list[list[float]], seed: int = 0) -> dict[str, float | None]:
    """Median pair ratio (of the log ratios of every cluster together) with its 95% interval
    from resampling whole clusters, the geometric mean, ``cluster_spread``: the standard
    deviation of the clusters' median log ratios (~ the relative spread from one set of engine
    processes to the next; None with one cluster), and that spread split into rounds and
    processes (``variance_parts``): ``round_spread``, ``process_spread`` (sd; 0 where the
    estimate is negative) and ``process_spread_high``, the 95th percentile of the latter over
    the same cluster resamples (how large a per-process offset the runs cannot exclude)."""
    rng = random.Random(seed)
    log_ratios = [x for cluster in clusters for x in cluster]
    resamples = [rng.choices(clusters, k=len(clusters)) for _ in range(BOOTSTRAP_RESAMPLES)]
    medians = sorted(statistics.median([x for c in r for x in c]) for r in resamples)
    summary: dict[str, float | None] = {
        "pairs": len(log_ratios), "clusters": len(clusters),
        "median": math.exp(statistics.median(log_ratios)),
        "median_low": math.exp(medians[int(0.025 * BOOTSTRAP_RESAMPLES)]),
        "median_high": math.exp(medians[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]),
        "geometric_mean": math.exp(statistics.fmean(log_ratios)),
        "cluster_spread": statistics.stdev(map(statistics.median, clusters))
        if len(clusters) > 1 else None,
        "round_spread": None, "process_spread": None, "process_spread_high": None}
    parts = variance_parts(clusters)
    if parts is not None:
        resampled = sorted(p[1] for r in resamples if (p := variance_parts(r)) is not None)
        summary |= {"round_spread": math.sqrt(parts[0]),
                    "process_spread": math.sqrt(max(parts[1], 0.0)),
                    "process_spread_high": math.sqrt(max(
                        resampled[int(0.95 * len(resampled)) - 1], 0.0)) if resampled else None}
    return summary


def pool(reports: list[dict[str, Any]], configs: Sequence[str], baseline: str,
         metric: str = "tokens_per_s") -> dict[str, dict[str, dict[str, float]]]:
    """``{"on/stock": {B: summary}}`` over every report's pairs (each report's generations
    are clusters)."""
    pooled: dict[str, dict[str, dict[str, float]]] = {}
    for config in configs:
        by_batch: dict[str, list[list[float]]] = {}
        for report in reports:
            for batch, clusters in paired_log_ratios(report, config, baseline, metric).items():
                by_batch.setdefault(batch, []).extend(clusters)
        if by_batch:
            pooled[f"{config}/{baseline}"] = {b: summarize(logs) for b, logs in
                                              sorted(by_batch.items(), key=lambda kv: int(kv[0]))}
    return pooled


def plot(pooled: dict[str, dict[str, dict[str, float]]], out: Path, title: str) -> None:
    """PNG of each pooled ratio's median pair and 95% interval against batch size."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--png needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for index, (name, by_batch) in enumerate(pooled.items()):
        shift = 1.0 + 0.03 * (index - (len(pooled) - 1) / 2)  # side by side, not on top
        batches = [int(b) for b in by_batch]
        medians = [v["median"] for v in by_batch.values()]
        errors = [[v["median"] - v["median_low"] for v in by_batch.values()],
                  [v["median_high"] - v["median"] for v in by_batch.values()]]
        ax.errorbar([b * shift for b in batches], medians, yerr=errors, marker="o", capsize=4,
                    label=f"{name} (median pair, 95% interval)")
        for b, m in zip(batches, medians):
            ax.annotate(f"{m:.3f}", (b * shift, m), textcoords="offset points", xytext=(8, -3),
                        fontsize=8)
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ticks = sorted({int(b) for by_batch in pooled.values() for b in by_batch})
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("throughput ratio to stock vLLM + FlashInfer")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--baseline", default="stock")
    parser.add_argument("--configs", default="on,optout,off")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path, help="Also plot the pooled ratios here.")
    parser.add_argument("--metric", default="tokens_per_s",
                        choices=("tokens_per_s", "median_step_tokens_per_s"),
                        help="The rounds' throughput to pair: output tokens / wall time, or "
                        "at the round's median engine step (insensitive to a few slow steps; "
                        "older runs of bench_engine_throughput.py lack it).")
    args = parser.parse_args(argv)
    reports = [engine_shaped(json.loads(path.read_text())) for path in args.files]
    result = {"files": [str(p) for p in args.files], "metric": args.metric,
              "pooled": pool(reports, args.configs.split(","), args.baseline, args.metric)}
    for name, by_batch in result["pooled"].items():
        for batch, v in by_batch.items():
            print(f"{name} B={batch}: {v['pairs']} pairs in {v['clusters']} clusters, "
                  f"median {v['median']:.3f} "
                  f"[95% {v['median_low']:.3f}, {v['median_high']:.3f}], "
                  f"geometric mean {v['geometric_mean']:.3f}"
                  + ("" if v["cluster_spread"] is None
                     else f", clusters' medians spread {v['cluster_spread']:.3f} (sd of logs)")
                  + ("" if v["round_spread"] is None
                     else f"; rounds {v['round_spread']:.3f}, processes "
                          f"{v['process_spread']:.3f} (95th pct {v['process_spread_high']:.3f})"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    if args.png:
        pairs = max(v["pairs"] for by_batch in result["pooled"].values() for v in by_batch.values())
        clusters = max(v["clusters"] for by_batch in result["pooled"].values()
                       for v in by_batch.values())
        plot(result["pooled"], args.png, f"{len(reports)} interleaved runs pooled ({pairs} paired "
             f"rounds per batch size, {clusters} sets of engine processes)")
    return result


if __name__ == "__main__":
    main()
