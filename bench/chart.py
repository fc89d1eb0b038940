"""bench/results/throughput.png: Table 1's images/s per pipeline and worker count, Table 2's speedups."""

from __future__ import annotations

import pathlib

METHOD_STYLE = {  # label, colour
    "sequential": ("sequential", "#9e9e9e"),
    "dataloader": ("PyTorch DataLoader", "#ee8a3c"),
    "batchd_tcp": ("batchd TCP (data plane)", "#5b9bd5"),
    "batchd_shm": ("batchd shm", "#1f4e9c"),
}


def draw(results: dict, path: pathlib.Path) -> pathlib.Path | None:
    t1, t2 = results.get("table1"), results.get("table2")
    if not t1 and not t2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    workers = sorted({row["workers"] for row in t1["rows"]}) if t1 else []
    panels = len(workers) + (1 if t2 else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.2), squeeze=False)
    axes = axes[0]
    top = max((max(row["median"].values()) for row in t1["rows"]), default=1) * 1.12 if t1 else 1
    for ax, w in zip(axes, workers):
        rows = [row for row in t1["rows"] if row["workers"] == w]
        x = np.arange(len(rows))
        width = 0.2
        for i, (m, (label, colour)) in enumerate(METHOD_STYLE.items()):
            ax.bar(x + (i - 1.5) * width, [row["median"][m] for row in rows], width, label=label, color=colour)
        ax.set_xticks(x, [row["pipeline"] for row in rows])
        ax.set_ylim(0, top)
        ax.set_title(f"Table 1: {w} worker{'s' if w > 1 else ''}, batch 64")
        ax.set_ylabel("images / s")
        ax.grid(axis="y", alpha=0.3)
    if t1:
        axes[0].legend(loc="upper right", fontsize=8)
    if t2:
        ax = axes[-1]
        sizes = [row["batch_size"] for row in t2["rows"]]
        for m in ("dataloader", "batchd_shm"):
            label, colour = METHOD_STYLE[m]
            ax.plot(sizes, [row["median"][m] / row["median"]["sequential"] for row in t2["rows"]], "o-",
                    label=label, color=colour)
        ax.axhline(1.0, color="#9e9e9e", lw=1, ls="--", label="sequential")
        ax.set_xscale("log")
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup over sequential")
        ax.set_ylim(bottom=0)
        ax.set_title(f"Table 2: {t2['workers']} workers, {t2['pipeline']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: pathlib.Path) -> pathlib.Path:
    """Write ``fig`` to ``path`` as PNG atomically (a temporary file, then a rename); close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path


LATENCY_STYLE = {  # table9 row -> colour, line style, marker
    "batchd": ("#1f4e9c", "-", "o"),
    "batchd_seq": ("#5b9bd5", "-", "v"),
    "dataloader2": ("#f4b183", "-", "s"),
    "dataloader16": ("#ee8a3c", "-", "D"),
    "s3_batchd": ("#1f4e9c", "--", "o"),
    "s3_dataloader2": ("#f4b183", "--", "s"),
    "s3_dataloader16": ("#ee8a3c", "--", "D"),
}


def draw_latency(results: dict, path: pathlib.Path) -> pathlib.Path | None:
    """bench/results/latency.png: Table 9's images/s against added latency, one line per row
    (FUSE rows solid, S3 rows dashed; x symmetric-log so 0 ms shows). None if Table 9 has no rows."""
    t9 = results.get("table9")
    if not t9 or t9.get("skipped") or not t9.get("rows"):
        return None
    from bench.tables.table_latency import LABELS

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(t9["rows"], key=lambda row: row["latency_ms"])
    x = [row["latency_ms"] for row in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for m in t9.get("methods", LATENCY_STYLE):
        colour, ls, marker = LATENCY_STYLE.get(m, ("#9e9e9e", ":", "."))
        label = LABELS.get(m, m) + ("" if m.startswith("s3_") else " (FUSE)")
        ax.plot(x, [row["median"][m] for row in rows], ls=ls, marker=marker, color=colour, label=label)
    ax.set_xscale("symlog", linthresh=2)
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.set_yscale("log")
    ax.set_xlabel("added latency per file open / S3 request (ms)")
    ax.set_ylabel("images / s")
    ax.set_title(f"Table 9: storage latency, {t9.get('pipeline', 'L3')}, batch {t9.get('batch_size', 64)}"
                 + (" (--quick)" if t9.get("quick") else ""))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7.5, loc="lower left")
    return _save(fig, path)
