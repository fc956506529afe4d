"""Plot the engine throughput ratio (masks on / off) against batch size, from the JSON of
``bench_engine_throughput.py``::

    python benchmarks/plot_throughput.py bench_out/engine_throughput.json --out docs/throughput.png

Left: every ratio the JSON has (on/off, and off/stock, on/stock when a stock engine ran), with
a line at 1.0. Right: the median output tokens/s of each engine. Needs matplotlib
(``pip install matplotlib``); runs headless.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

LABELS = {"off": "masks off", "on": "masks on", "stock": "stock (plugin not loaded)",
          "optout": "mask engine, requests opted out"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="Output of bench_engine_throughput.py --out.")
    parser.add_argument("--out", type=Path, help="PNG path (default: the JSON's, .png).")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("plot_throughput.py needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(args.json.read_text())
    config, results, ratios = report["config"], report["results"], report["ratios"]
    batch_sizes = config["batch_sizes"]
    out = args.out or args.json.with_suffix(".png")

    fig, (ax_ratio, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, by_batch in ratios.items():
        values = [by_batch[str(b)] for b in batch_sizes]
        ax_ratio.plot(batch_sizes, values, marker="o", label=name)
        for b, v in zip(batch_sizes, values):
            ax_ratio.annotate(f"{v:.3f}", (b, v), textcoords="offset points", xytext=(0, 6),
                              ha="center", fontsize=8)
    ax_ratio.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax_ratio.set_ylabel("throughput ratio")
    ax_ratio.set_title("output tokens/s ratio")
    for name, result in results.items():
        values = [result["by_batch"][str(b)]["median_tokens_per_s"] for b in batch_sizes]
        ax_tps.plot(batch_sizes, values, marker="o", label=LABELS.get(name, name))
    ax_tps.set_ylabel("output tokens/s (median)")
    ax_tps.set_title("throughput")
    for ax in (ax_ratio, ax_tps):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size (concurrent requests)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    env = report.get("environment", {})
    mode = "eager" if config.get("enforce_eager") else "compiled"
    fig.suptitle(f"{Path(config['model']).name} on {env.get('device')}, {mode}, "
                 f"{config['prompt_len']}->{config['output_len']} tokens, top_k {config['top_k']}, "
                 f"top_p {config['top_p']}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"written to {out}")
    return out


if __name__ == "__main__":
    main()
