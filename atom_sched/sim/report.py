"""What a simulation reports: a table per run (throughput, TTFT and inter-token latency
percentiles, preemptions, the recompute tax, prefix hit rate), per-priority TTFT, per tenant its
requests, share of the output tokens, TTFT and ITL, a JSON file and a PNG of the latency
distributions.

The recompute tax (docs/perf.md, "Serving simulator"): the tokens the engine computes again
because a preemption dropped their KV (what the prefix cache gives back at re-admission is not
computed, so not counted), as a share of every token computed; JSON ``recompute`` holds the
tokens, the share, the KV positions preemptions dropped and the re-admissions."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .simulator import SimResult

PERCENTILES = (50, 90, 99)


def _pct(x: np.ndarray) -> list[float | None]:
    return [float(np.percentile(x, p)) if x.size else None for p in PERCENTILES]


def summary(r: SimResult) -> dict[str, Any]:
    ttft, itl = _pct(r.ttft()), _pct(r.itl())
    out: dict[str, Any] = {
        "label": r.label, "rate_conv_per_s": None if math.isinf(r.rate) else r.rate,
        "requests": len(r.requests), "output_tokens": r.output_tokens, "steps": r.steps,
        "duration_s": r.duration, "throughput_tok_s": r.throughput,
        "throughput_req_s": r.request_throughput,
        "ttft_s": dict(zip(("p50", "p90", "p99"), ttft, strict=True)),
        "itl_s": dict(zip(("p50", "p90", "p99"), itl, strict=True)),
        "preemptions": int(r.stats["num_preemptions"]),
        "computed_tokens": r.computed_tokens,
        "recompute": {"tokens": r.recomputed_tokens, "share": r.recompute_tax,
                      "preempted_tokens": r.preempted_tokens, "readmissions": r.readmissions},
        "prefix_hit_rate": r.prefix_hit_rate,
        "config": r.config,
    }
    classes = sorted({q.priority for q in r.requests})
    if len(classes) > 1:
        out["ttft_by_priority_s"] = {
            str(c): dict(zip(("p50", "p90", "p99"), _pct(r.ttft(c)), strict=True))
            for c in classes}
    tenants = sorted({q.tenant for q in r.requests})
    if len(tenants) > 1:
        out["by_tenant"] = {t: {
            "requests": sum(1 for q in r.requests if q.tenant == t),
            "output_tokens": r.output_tokens_of(t),
            "ttft_s": dict(zip(("p50", "p90", "p99"), _pct(r.ttft(tenant=t)), strict=True)),
            "itl_s": dict(zip(("p50", "p90", "p99"), _pct(r.itl(tenant=t)), strict=True)),
        } for t in tenants}
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:,.0f}"


def format_table(results: list[SimResult]) -> str:
    head = ["run", "conv/s", "tok/s", "req/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
            "preempt", "recompute tax", "hit rate"]
    rows = []
    for r in results:
        s = summary(r)
        rate = "all at 0" if s["rate_conv_per_s"] is None else f"{s['rate_conv_per_s']:.2f}"
        t, i = s["ttft_s"], s["itl_s"]
        rows.append([r.label, rate, f"{s['throughput_tok_s']:,.0f}",
                     f"{s['throughput_req_s']:.2f}",
                     "/".join(_ms(t[k]) for k in ("p50", "p90", "p99")),
                     "/".join(_ms(i[k]) for k in ("p50", "p90", "p99")),
                     str(s["preemptions"]), f"{100 * r.recompute_tax:.2f}%",
                     f"{100 * s['prefix_hit_rate']:.1f}%"])
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    line = " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    out = [line, "-+-".join("-" * w for w in widths)]
    out += [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    for r in results:
        s = summary(r)
        for c, p in s.get("ttft_by_priority_s", {}).items():
            out.append(f"{r.label}: priority {c} TTFT p50/p90/p99 ms "
                       + "/".join(_ms(p[k]) for k in ("p50", "p90", "p99")))
        for t, v in s.get("by_tenant", {}).items():
            share = v["output_tokens"] / max(1, s["output_tokens"])
            out.append(f"{r.label}: tenant {t}: {v['requests']} requests, "
                       f"{100 * share:.1f}% of output tokens, TTFT p50/p90/p99 ms "
                       + "/".join(_ms(v["ttft_s"][k]) for k in ("p50", "p90", "p99"))
                       + ", ITL p50/p90/p99 ms "
                       + "/".join(_ms(v["itl_s"][k]) for k in ("p50", "p90", "p99")))
    return "\n".join(out)


def write_json(path: Path, results: list[SimResult], meta: dict[str, Any]) -> None:
    path.write_text(json.dumps({"meta": meta, "runs": [summary(r) for r in results]}, indent=2))


def plot(path: Path, results: list[SimResult]) -> bool:
    """CDFs of inter-token latency and TTFT, one curve per run (log x). False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, what, get in ((axes[0], "inter-token latency", SimResult.itl),
                          (axes[1], "time to first token", SimResult.ttft)):
        for r in results:
            x = np.sort(get(r)) * 1000
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=r.label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{what} (ms, simulated)")
        ax.set_ylabel("fraction of tokens" if "inter" in what else "fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
