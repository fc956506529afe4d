"""Pool the paired rounds of several interleaved ``bench_engine_throughput.py`` runs.

A run with ``--interleave`` gives every engine a round next to each round of the baseline, so
``on`` round r over ``stock`` round r cancels the machine's drift over minutes; single runs of
6-14 rounds still cannot resolve a few percent on the lent H200. This script takes the runs'
JSON files, forms every pair (config / baseline, same batch size, same round index), and
reports per batch size the number of pairs, their median with a 95% bootstrap interval (4000
resamples, fixed seed) and their geometric mean::

    python benchmarks/pool_paired_rounds.py docs/results/engine_throughput_h200_*.json \\
        --baseline stock --out bench_out/pooled.json

Files without the baseline or a config are skipped for that config.
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


def paired_log_ratios(report: dict[str, Any], config: str,
                      baseline: str) -> dict[str, list[float]]:
    """``{B: [log(config round r / baseline round r), ...]}`` of one run's JSON report."""
    results = report.get("results", {})
    if config not in results or baseline not in results:
        return {}
    pairs: dict[str, list[float]] = {}
    for batch, ours in results[config]["by_batch"].items():
        theirs = results[baseline]["by_batch"].get(batch)
        if theirs is None:
            continue
        pairs[batch] = [math.log(a["tokens_per_s"] / b["tokens_per_s"])
                        for a, b in zip(ours["rounds"], theirs["rounds"])]
    return pairs


def summarize(log_ratios: list[float], seed: int = 0) -> dict[str, float]:
    """Median pair ratio with its 95% bootstrap interval, and the geometric mean."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(log_ratios, k=len(log_ratios)))
                     for _ in range(BOOTSTRAP_RESAMPLES))
    return {"pairs": len(log_ratios), "median": math.exp(statistics.median(log_ratios)),
            "median_low": math.exp(medians[int(0.025 * BOOTSTRAP_RESAMPLES)]),
            "median_high": math.exp(medians[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]),
            "geometric_mean": math.exp(statistics.fmean(log_ratios))}


def pool(reports: list[dict[str, Any]], configs: Sequence[str],
         baseline: str) -> dict[str, dict[str, dict[str, float]]]:
    """``{"on/stock": {B: summary}}`` over every report's pairs."""
    pooled: dict[str, dict[str, dict[str, float]]] = {}
    for config in configs:
        by_batch: dict[str, list[float]] = {}
        for report in reports:
            for batch, logs in paired_log_ratios(report, config, baseline).items():
                by_batch.setdefault(batch, []).extend(logs)
        if by_batch:
            pooled[f"{config}/{baseline}"] = {b: summarize(logs) for b, logs in
                                              sorted(by_batch.items(), key=lambda kv: int(kv[0]))}
    return pooled


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--baseline", default="stock")
    parser.add_argument("--configs", default="on,optout")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    reports = [json.loads(path.read_text()) for path in args.files]
    result = {"files": [str(p) for p in args.files],
              "pooled": pool(reports, args.configs.split(","), args.baseline)}
    for name, by_batch in result["pooled"].items():
        for batch, v in by_batch.items():
            print(f"{name} B={batch}: {v['pairs']} pairs, median {v['median']:.3f} "
                  f"[95% {v['median_low']:.3f}, {v['median_high']:.3f}], "
                  f"geometric mean {v['geometric_mean']:.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
