"""Results out: a terminal table, the small-vs-large comparison, a JSON file, a bar chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .runner import Measurement, Summary, as_dicts


def _f(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _cache(s: Summary) -> str:
    if s.resident_after_drop is None:
        return s.cache or "-"
    return f"{s.cache} ({s.resident_after_drop:.0%} cached)"


def _objects(s: Summary) -> str:
    """Objects a save left (files, and directories, on a local target; keys and the requests it took on S3)."""
    if s.files is None:
        return "-"
    if s.save_requests is not None:
        return f"{s.files:.0f} ({s.save_requests:.0f} req)"
    return f"{s.files:.0f}+{_f(s.dirs, '.0f')}d"


def table(summaries: list[Summary]) -> str:
    """One row per (state, method, target): median GB/s, ratio to raw, how the read was made cold. For the async
    saves: the median blocking time, the median plain copy of the same bytes (timed just before each save) and
    their ratio, which is the one of the two columns beside it."""
    header = (
        "state",
        "method",
        "target",
        "save GB/s",
        "load GB/s",
        "save/raw",
        "load/raw",
        "block s",
        "copy s",
        "blk/copy",
        "blk/dcp-as",
        "read cache",
        "+RSS save/load MiB",
        "objects",
        "n",
    )
    rows = [header]
    for s in summaries:
        rows.append(
            (
                f"{s.state} ({s.tensors} t, {s.nbytes / 2**20:.0f} MiB)",
                s.method,
                s.target,
                _f(s.save_gbps, ".3f", "FAILED"),
                _f(s.load_gbps, ".3f", "-" if s.target == "memory" else "FAILED"),
                _f(s.save_vs_raw, ".2f"),
                _f(s.load_vs_raw, ".2f"),
                _f(s.blocking_s, ".4g"),  # (significant digits: a tiny state's copy takes microseconds)
                _f(s.copy_s, ".4g"),
                _f(s.blocking_vs_copy, ".2f"),
                _f(s.blocking_vs_dcp_async, ".2f"),
                _cache(s),
                f"{_f(s.save_peak_rss_mib, '.0f')}/{_f(s.load_peak_rss_mib, '.0f')}",
                _objects(s),
                str(s.repeats),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    numeric = {3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14}
    lines = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    multi = [s for s in summaries if s.procs > 1]
    if multi:
        lines.append(
            f"--procs {multi[0].procs}: times are the max over ranks, GB/s the aggregate (all ranks' bytes / that time);"
            " slowest rank's own GB/s save/load: "
            + ", ".join(
                f"{s.method}@{s.target} {_f(s.rank_min_save_gbps, '.2f')}/{_f(s.rank_min_load_gbps, '.2f')}"
                for s in multi
            )
        )
    for s in summaries:
        for e in dict.fromkeys(s.errors):
            lines.append(f"! {s.method} on {s.target} ({s.state}): {e}")
    return "\n".join(lines)


def small_vs_large(summaries: list[Summary]) -> str:
    """The cost of many tiny tensors: each method's time on the 'small' state against the same bytes in
    a few large tensors, on the same target."""
    by_key = {(s.state, s.method, s.target): s for s in summaries}
    lines = []
    for s in summaries:
        big = by_key.get(("large", s.method, s.target))
        if s.state != "small" or big is None:
            continue
        parts = []
        for op, a, b in (("save", s.save_s, big.save_s), ("load", s.load_s, big.load_s)):
            ratio = f"{a / b:.1f}x" if a and b else "-"
            parts.append(f"{op} {_f(a, '.2f')} s vs {_f(b, '.2f')} s ({ratio})")
        lines.append(
            f"{s.method:>6} on {s.target:<5}: {s.tensors} tensors vs {big.tensors}, {s.nbytes / 2**20:.0f} MiB: "
            + "; ".join(parts)
        )
    if not lines:
        return ""
    return "many small tensors vs the same bytes in a few large ones (median seconds):\n" + "\n".join(lines)


def write_json(path: str | Path, config: dict[str, Any], results: list[Measurement], summaries: list[Summary]) -> None:
    doc = {"config": config, "results": as_dicts(results), "medians": as_dicts(summaries)}
    Path(path).write_text(json.dumps(doc, indent=1))


def write_png(path: str | Path, summaries: list[Summary], title: str) -> None:
    """One picture per target with every method on it (GB/s, save and load side by side), then the async saves'
    blocking time; the main state only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [s for s in summaries if s.state == summaries[0].state] if summaries else []
    targets = list(dict.fromkeys(s.target for s in main if s.target != "memory"))  # the copy: blocking panel only
    blocking = [s for s in main if s.blocking_s is not None]
    methods = max((sum(s.target == t for s in main) for t in targets), default=1)
    panels = len(targets) + (1 if blocking else 0)
    fig, axes = plt.subplots(1, panels, figsize=(min(24.0, max(9.0, 0.7 * methods * panels)), 4.5), squeeze=False)
    for ax, target in zip(axes[0], targets):
        rows = [s for s in main if s.target == target]
        for j, op in enumerate(("save", "load")):
            xs = [i + (j - 0.5) * 0.4 for i in range(len(rows))]
            bars = ax.bar(xs, [getattr(s, f"{op}_gbps") or 0.0 for s in rows], 0.4, label=op)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(rows)), [s.method for s in rows], rotation=30, ha="right")
        ax.set_title(f"{target}: every method")
        ax.set_ylabel("GB/s (median)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    if blocking:
        ax = axes[0][-1]
        labels = [f"{s.method}\n{s.target}" for s in blocking]
        bars = ax.bar(range(len(blocking)), [s.blocking_s for s in blocking], 0.7, color="tab:red")
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.set_xticks(range(len(blocking)), labels, fontsize=7, rotation=30, ha="right")
        ax.set_title("async save: blocking s (copy = floor)")
        ax.set_ylabel("seconds (median)")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
