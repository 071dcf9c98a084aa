"""PNG plots of a session's timeline (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import io
from typing import Optional

PLOT_NAMES = ("throughput.png", "kv_usage.png", "batch_sizes.png", "micro_batch_tokens.png",
              "execution_modes.png")


def _figure(width: float = 8.0, height: float = 3.6, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=100)
    # fixed margins: tight_layout would cost a third of the render, and reports redraw often
    fig.subplots_adjust(left=0.09 if ncols == 1 else 0.07, right=0.9 if ncols == 1 else 0.97,
                        bottom=0.15, top=0.9, wspace=0.25)
    return plt, fig, axes


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def render_plots(timeline: list[dict], batch_histogram: Optional[dict] = None,
                 title: str = "") -> dict[str, bytes]:
    """{file name: PNG bytes}; empty when there is nothing to draw yet."""
    if not timeline:
        return {}
    t = [s["t"] for s in timeline]
    out = {}

    plt, fig, ax = _figure()
    ax.plot(t, [s.get("output_tokens_per_s", 0) for s in timeline], label="output tok/s")
    ax.plot(t, [s.get("prefill_tokens_per_s", 0) for s in timeline], label="prefill tok/s",
            alpha=0.7)
    ax.set_xlabel("seconds since session start")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Throughput {title}".strip())
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    out["throughput.png"] = _png(plt, fig)

    plt, fig, ax = _figure()
    ax.plot(t, [100 * s.get("kv_usage", 0) for s in timeline], label="KV usage (end of interval)")
    ax.plot(t, [100 * s.get("kv_usage_max", 0) for s in timeline], label="KV usage (max)",
            alpha=0.6)
    predicted = [(s["t"], 100 * s["kv_predicted"]) for s in timeline if "kv_predicted" in s]
    if predicted:   # the strategy's forecast for the same moment (e.g. arXiv:2506.10470 Fig. 12)
        ax.plot(*zip(*predicted), ".", color="tab:red", markersize=3, label="KV usage predicted")
    store = [(s["t"], 100 * s["kv_store_usage"]) for s in timeline if "kv_store_usage" in s]
    if store:       # a second tier (a CPU KV store)
        ax.plot(*zip(*store), color="tab:purple", label="CPU KV store usage")
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds since session start")
    ax.set_ylabel("% of KV blocks in use")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(t, [s.get("num_running", 0) for s in timeline], color="tab:green", alpha=0.5,
             label="running sequences")
    ax2.set_ylabel("running sequences")
    ax.set_title(f"KV cache {title}".strip())
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right")
    out["kv_usage.png"] = _png(plt, fig)

    plt, fig, (left, right) = _figure(width=10.0, ncols=2)
    left.plot(t, [s.get("batch_size_mean", 0) for s in timeline], label="mean")
    left.plot(t, [s.get("batch_size_max", 0) for s in timeline], label="max", alpha=0.6)
    left.set_xlabel("seconds since session start")
    left.set_ylabel("sequences per step")
    left.set_title("Batch size over time")
    left.grid(alpha=0.3)
    left.legend(loc="upper right")
    if batch_histogram:
        sizes = sorted(int(k) for k in batch_histogram)
        counts = [batch_histogram[str(k)] for k in sizes]
        if sizes[-1] - sizes[0] < 40:
            right.bar(sizes, counts, width=0.9)
        else:  # many distinct sizes: bin them so the bars stay visible
            right.hist(sizes, weights=counts, bins=40, range=(sizes[0] - 0.5, sizes[-1] + 0.5))
    right.set_xlabel("sequences per step")
    right.set_ylabel("steps")
    right.set_title("Batch size histogram")
    out["batch_sizes.png"] = _png(plt, fig)
    tokens = _micro_batch_tokens(timeline, title)
    if tokens is not None:
        out["micro_batch_tokens.png"] = tokens
    modes = _execution_modes(timeline, title)
    if modes is not None:
        out["execution_modes.png"] = modes
    return out


def job_plots(timeline: list[dict], session: dict, events: list[dict]) -> dict[str, bytes]:
    """A running job's plots: render_plots', the pipeline's micro-batches (`events`: the
    engine's timeline) and the online predictor's forecast error, each where it has data."""
    plots = render_plots(timeline, session["batch_size"]["histogram"])
    online = (session.get("predictor") or {}).get("online") or {}
    drawn = {"pipeline_timeline.png": plot_pipeline(events) if events else None,
             "forecast_error.png": (plot_forecast_error(online["timeline"])
                                    if online.get("timeline") else None)}
    plots.update({name: png for name, png in drawn.items() if png})
    return plots


def _execution_modes(timeline: list[dict], title: str) -> Optional[bytes]:
    """The largest micro-batch and the share of steps in each execution mode over time (e.g.
    weights vs compute as a service, arXiv:2605.28095 Fig. 15)."""
    rows = [s for s in timeline if s.get("mode_steps") and "mb_tokens_max" in s]
    if not rows:
        return None
    t = [s["t"] for s in rows]
    modes = sorted({m for s in rows for m in s["mode_steps"]})
    plt, fig, ax = _figure()
    ax.step(t, [s["mb_tokens_max"] for s in rows], where="post", color="black", linewidth=0.8,
            label="largest micro-batch (tokens)")
    ax.set_yscale("symlog")
    ax.set_xlabel("seconds since session start")
    ax.set_ylabel("tokens per micro-batch")
    ax.grid(alpha=0.3)
    share = ax.twinx()
    for mode in modes:
        share.step(t, [100 * s["mode_steps"].get(mode, 0) / sum(s["mode_steps"].values())
                       for s in rows], where="post", alpha=0.7, label=f"% steps in {mode.upper()}")
    share.set_ylim(0, 105)
    share.set_ylabel("% of steps")
    ax.set_title(f"Execution mode over time {title}".strip())
    lines, lines2 = ax.get_legend_handles_labels(), share.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize="small")
    return _png(plt, fig)


def _micro_batch_tokens(timeline: list[dict], title: str) -> Optional[bytes]:
    """Tokens per micro-batch over time (arXiv:2504.14775 Fig. 4b): the mean split into prefill and decode,
    with the smallest and largest micro-batch of each interval."""
    rows = [s for s in timeline if "mb_prefill_mean" in s]
    if not rows:
        return None
    t = [s["t"] for s in rows]
    prefill = [s["mb_prefill_mean"] for s in rows]
    decode = [s["mb_decode_mean"] for s in rows]
    plt, fig, ax = _figure()
    ax.stackplot(t, decode, prefill, labels=["decode tokens (mean)", "prefill tokens (mean)"],
                 alpha=0.6, step="post")
    ax.step(t, [s["mb_tokens_max"] for s in rows], where="post", color="black", linewidth=0.8,
            label="largest micro-batch")
    ax.step(t, [s["mb_tokens_min"] for s in rows], where="post", color="gray", linewidth=0.8,
            linestyle="--", label="smallest micro-batch")
    ax.set_xlabel("seconds since session start")
    ax.set_ylabel("tokens per micro-batch")
    ax.set_title(f"Batched tokens per micro-batch {title}".strip())
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    return _png(plt, fig)


def plot_forecast_error(timeline: list[dict]) -> Optional[bytes]:
    """The online length predictor over the job (issue 43): per window of finished requests, the
    error of their summed forecasts, as they finished (online) and as they were admitted."""
    rows = [w for w in timeline if w.get("error_online") is not None]
    if not rows:
        return None
    x = [w["finished"] for w in rows]
    plt, fig, ax = _figure()
    ax.plot(x, [100 * w["error_online"] for w in rows], "o-", label="forecast when it finished "
            "(online)")
    ax.plot(x, [100 * w["error_prior"] for w in rows], "s--", alpha=0.7,
            label="forecast at admission")
    ax.set_xlabel("requests finished")
    ax.set_ylabel("|sum forecast - sum actual| / sum actual (%)")
    ax.set_title("Output-length forecast error over the job (per window of finished requests)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    return _png(plt, fig)


def plot_pipeline(events: list[dict], last_micro_batches: int = 48) -> Optional[bytes]:
    """Gantt chart of the most recent micro-batches: one row per rank, forward bars coloured by
    micro-batch, receive waits hatched."""
    forwards = [e for e in events if e["kind"] == "forward"]
    if not forwards:
        return None
    recent = sorted({e["mb"] for e in forwards})[-last_micro_batches:]
    keep = set(recent)
    shown = [e for e in events if e["mb"] in keep and e["kind"] in ("forward", "recv")]
    t0 = min(e["start"] for e in shown)
    ranks = sorted({e["rank"] for e in shown})
    row = {rank: i for i, rank in enumerate(ranks)}
    plt, fig, ax = _figure(width=10.0, height=1.2 + 0.5 * len(ranks))
    colours = plt.get_cmap("tab10")
    for e in shown:
        x, w = e["start"] - t0, e["end"] - e["start"]
        y = row[e["rank"]]
        if e["kind"] == "forward":
            ax.broken_barh([(x, w)], (y - 0.35, 0.7), facecolors=colours(e["mb"] % 10))
        else:
            ax.broken_barh([(x, w)], (y - 0.15, 0.3), facecolors="none", edgecolors="grey",
                           hatch="///")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (forward: coloured by micro-batch; hatched: waiting to receive)")
    ax.set_title(f"Pipeline timeline, last {len(recent)} micro-batches")
    return _png(plt, fig)
