"""Draws the performance guide's figures from `benchmarks/results.json`.

Not a test and not needed by one: run it after updating the JSON with a
benchmark's new figures, then commit the images.

    python benchmarks/plot_results.py          # needs matplotlib

Writes `guides/images/ratios.png` (keras_dist / anchor per backend and
strategy) and `guides/images/bytes_per_device.png`.
"""

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLORS = {"jax": "#4c72b0", "tensorflow": "#dd8452", "torch": "#c44e52"}


def plot_ratios(results, path, plt):
    """One horizontal bar per (backend, strategy, anchor) row."""
    rows = results["ratios"]
    labels = [
        f"{r['backend']}: {r['strategy']}\nvs {r['anchor']}" for r in rows
    ]
    values = [r["ratio"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.48 * len(rows) + 1.2))
    y = range(len(rows))
    ax.barh(y, values, color=[COLORS[r["backend"]] for r in rows])
    for i, value in zip(y, values):
        ax.text(value + 0.01, i, f"{value:.3f}", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.15)
    ax.set_xlabel("step time, keras_dist / anchor (lower is faster)")
    ax.set_title("keras_dist against each backend's own tool", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bytes(results, path, plt):
    """Bytes of parameters and optimizer slots on one device."""
    data = results["bytes_per_device"]
    rows = data["rows"]
    labels = [r["strategy"] for r in rows]
    values = [r["bytes"] / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 2.4))
    ax.barh(range(len(rows)), values, color=COLORS["jax"])
    for i, value in enumerate(values):
        ax.text(value + 0.05, i, f"{value:.2f} MB", va="center", fontsize=8)
    ax.axvline(
        data["ideal"] / 1e6, color="black", linestyle="--", linewidth=0.8
    )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.2)
    ax.set_xlabel("MB on device 0 (dashed: total / 4 devices)")
    ax.set_title("Model and optimizer state per device (JAX, 4 devices)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    """Reads the JSON and writes both images."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--results", default=str(ROOT / "benchmarks" / "results.json")
    )
    parser.add_argument("--out", default=str(ROOT / "guides" / "images"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(pathlib.Path(args.results).read_text())
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_ratios(results, out / "ratios.png", plt)
    plot_bytes(results, out / "bytes_per_device.png", plt)
    print(f"wrote {out / 'ratios.png'} and {out / 'bytes_per_device.png'}")


if __name__ == "__main__":
    main()
