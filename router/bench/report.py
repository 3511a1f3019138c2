"""What a benchmark leaves behind: the table it prints, its JSON report, its latency plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from router.bench.runner import BenchReport, LoadPoint

_COLUMNS = ("load", "ok", "fail", "req/s", "out tok/s", "TTFT p50/p90/p99 ms",
            "ITL p50/p90/p99 ms", "E2E p50/p90/p99 s")


def _ms(s) -> str:
    return f"{s.p50:.1f}/{s.p90:.1f}/{s.p99:.1f}"


def _row(point: LoadPoint) -> tuple[str, ...]:
    s = point.summary
    return (point.load.label, str(s.completed), str(s.failed), f"{s.request_throughput:.2f}",
            f"{s.output_throughput:.1f}", _ms(s.ttft), _ms(s.itl),
            f"{s.e2e.p50 / 1e3:.2f}/{s.e2e.p90 / 1e3:.2f}/{s.e2e.p99 / 1e3:.2f}")


def format_table(report: BenchReport) -> str:
    """One row per load point, as a Markdown table (it reads as plain text too)."""
    rows = [_COLUMNS, *(_row(p) for p in report.points)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def as_json(report: BenchReport) -> dict:
    """The report: settings, and per load point its summary and each request's numbers."""
    return {
        "config": report.config.describe(),
        "model": report.model,
        "points": [{
            "load": p.load.as_dict(),
            "summary": p.summary.as_dict(),
            "requests": [{"ok": r.ok, "error": r.error, "prompt_tokens": r.prompt_tokens,
                          "output_tokens": r.output_tokens, "start_s": round(r.start_s, 6),
                          "ttft_s": round(r.ttft_s, 6), "e2e_s": round(r.e2e_s, 6)}
                         for r in p.results],
        } for p in report.points],
    }


def write_json(report: BenchReport, path: str) -> None:
    Path(path).write_text(json.dumps(as_json(report), indent=2) + "\n", encoding="utf-8")


def _load_value(point: LoadPoint) -> float:
    load = point.load
    if load.concurrency is not None:
        return float(load.concurrency)
    # an infinite rate is plotted at the rate the server actually sustained
    rate = load.request_rate
    return point.summary.request_throughput if math.isinf(rate) else rate


def plot(report: BenchReport, path: str) -> None:
    """A PNG of TTFT, ITL and end-to-end latency (p50 and p99) and throughput against load."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    points = report.points
    by_concurrency = points[0].load.concurrency is not None
    x = [_load_value(p) for p in points]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, name, title in zip(axes, ("ttft", "itl", "e2e"),
                               ("time to first token", "inter-token latency",
                                "end-to-end latency")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [getattr(getattr(p.summary, name), q) for p in points], style, label=q)
        ax.set_title(title)
        ax.set_ylabel("ms")
        ax.legend()
    axes[3].plot(x, [p.summary.output_throughput for p in points], "o-")
    axes[3].set_title("output throughput")
    axes[3].set_ylabel("tokens/s")
    for ax in axes:
        ax.set_xlabel("requests in flight" if by_concurrency else "request rate (req/s)")
        ax.grid(True, alpha=0.3)
        if by_concurrency and len(set(x)) > 1:
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [f"{v:g}" for v in x])
            ax.minorticks_off()
    c = report.config
    fig.suptitle(f"{report.model} via {c.backend} ({c.endpoint}): input {c.input_len}, "
                 f"output {c.output_len} tokens, temperature {c.temperature:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
