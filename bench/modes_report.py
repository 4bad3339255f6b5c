"""Outputs of ``bench/modes_bench.py``: ``modes_bench.json``, ``modes_bench.md`` (the table and the simulator's
validation), ``modes_bench.png`` (samples/s per mode with spread, and a timeline of trainer/roller busy
intervals per mode), and the ``RESULT`` line."""

from __future__ import annotations

import json
import math
from pathlib import Path

from schedule_sim import validate

MODES = ("sync", "one-step-off", "fully-async")


def _get(d: dict, *keys, default=math.nan):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def result_line(results: dict) -> str:
    """``RESULT sync_sps=… … trl_sps=… longtail_trl_sps=…`` (main workload, steady state, but for the
    ``longtail_*`` keys; nan where not measured)."""
    main, tail = results["workloads"].get("main", {}), results["workloads"].get("longtail", {})
    sps = {m: _get(main, "best", m, "samples_per_s") for m in MODES}
    tail_sync, tail_fa = _get(tail, "best", "sync", "samples_per_s"), _get(tail, "best", "fully-async", "samples_per_s")
    values = {
        "sync_sps": sps["sync"], "one_step_off_sps": sps["one-step-off"], "fully_async_sps": sps["fully-async"],
        "speedup_one_step_off": sps["one-step-off"] / sps["sync"],
        "speedup_fully_async": sps["fully-async"] / sps["sync"],
        "longtail_speedup_fully_async": tail_fa / tail_sync,
        "max_staleness_fully_async": _get(main, "best", "fully-async", "staleness_max"),
        "limit_sps": _get(main, "limit", "limit_sps"),
        "trl_sps": _get(main, "trl", "samples_per_s"),
        "longtail_trl_sps": _get(tail, "trl", "samples_per_s"),
    }
    return "RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def table(results: dict) -> str:
    lines = []
    for name, wl in results["workloads"].items():
        lim = _get(wl, "limit", "limit_sps")
        lines += [f"### workload `{name}` (limit_sps = {lim:.3f})", "",
                  "| mode | split | samples/s (median, min-max) | share of limit | tokens/s | trainer idle | "
                  "roller idle | sync share | staleness mean/max | window s | wall s | runs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for mode in MODES:
            b = wl["best"].get(mode)
            if b is None:
                continue
            if "error" in b:
                lines.append(f"| {mode} | — | failed: {b['error']} | | | | | | | | | |")
                continue
            lo, hi = b["spread_sps"]
            lines.append(
                f"| {mode} | {b['split']['key']} | {b['samples_per_s']:.3f} ({lo:.3f}-{hi:.3f}) | "
                f"{b['samples_per_s'] / lim:.0%} | {b['tokens_per_s']:.1f} | {b['trainer_idle_share']:.0%} | "
                f"{b['roller_idle_share']:.0%} | {b['sync_share']:.0%} | {b['staleness_mean']:.2f}/"
                f"{b['staleness_max']} | {b['window_s']:.0f} | {b['wall_s']:.0f} | {b['num_runs']} |")
        if "trl" in wl:
            trl = wl["trl"]
            sps = trl.get("samples_per_s")
            lines.append(f"| TRL GRPOTrainer | 1 process, {results['cores']} threads | "
                         + (f"{sps:.3f} ({trl['spread_sps'][0]:.3f}-{trl['spread_sps'][1]:.3f}) | {sps / lim:.0%} | "
                            f"{trl.get('tokens_per_s') or math.nan:.1f} | | | | | "
                            f"{trl['window_s']:.0f} | {trl['wall_s']:.0f} | {trl['num_runs']} |" if sps
                            else f"{trl.get('error')} | | | | | | | | | |"))
        lines += ["", "every run, in order (the first run of each split is its sweep run):", ""]
        for r in wl["runs"]:
            sps = f"{r['samples_per_s']:.3f} samples/s" if "error" not in r else r["error"]
            lines.append(f"- {r['mode']} {r['split']['key']}: {sps}")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, axes = plt.subplots(1 + len(MODES), 1, figsize=(10, 3 + 2.2 * len(MODES)),
                             gridspec_kw={"height_ratios": [2] + [1] * len(MODES)})
    ax = axes[0]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        wl = results["workloads"][name]
        ys = [_get(wl, "best", m, "samples_per_s") for m in MODES]
        err = [[y - _get(wl, "best", m, "spread_sps", default=[y, y])[0] for m, y in zip(MODES, ys, strict=True)],
               [_get(wl, "best", m, "spread_sps", default=[y, y])[1] - y for m, y in zip(MODES, ys, strict=True)]]
        xs = [j + i * width for j in range(len(MODES))]
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=f"{name}")
        lim = _get(wl, "limit", "limit_sps")
        if math.isfinite(lim):
            ax.axhline(lim, linestyle="--", linewidth=1, color=f"C{i}", label=f"{name} limit")
    for i, name in enumerate(names):
        trl = _get(results["workloads"][name], "trl", "samples_per_s")
        if math.isfinite(trl):
            ax.axhline(trl, linestyle=":", color=f"C{i}", label=f"{name} TRL")
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(MODES))], MODES)
    ax.set_ylabel("trained samples/s")
    ax.legend(fontsize=8)
    ax.set_title("schedules at their best split (median, min-max)")
    main = results["workloads"].get("main") or results["workloads"][names[0]]
    for ax, mode in zip(axes[1:], MODES, strict=True):
        runs = [r for r in main["runs"] if r.get("mode") == mode and "error" not in r
                and r["split"]["key"] == _get(main, "best", mode, "split", "key", default=None)]
        if not runs:
            ax.set_axis_off()
            continue
        tl = runs[0]["timeline"]
        t0 = tl["t0"]
        rows = [("trainer update", tl["update"], "C0"), ("weight sync", tl["sync"], "C3")]
        rows += [(f"{name} busy", iv, "C2") for name, iv in tl["rollers"].items()]
        for y, (_, iv, color) in enumerate(rows):
            ax.broken_barh([(s - t0, e - s) for s, e in iv if e > t0], (y - 0.4, 0.8), color=color)
        ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
        ax.set_xlim(0, tl["t1"] - t0)
        ax.set_title(f"{mode} ({runs[0]['split']['key']}): steady-state window, seconds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(results: dict, out: Path) -> str:
    """Write the JSON, the markdown table and the plot into ``out``; return the RESULT line."""
    json_path = out / "modes_bench.json"
    json_path.write_text(json.dumps(results, indent=1, default=float))
    try:
        results["validation"] = validate(json_path)
    except Exception as exc:  # noqa: BLE001 - the measurement stands without the simulator
        results["validation"] = [{"error": f"{type(exc).__name__}: {exc}"}]
    line = result_line(results)
    results["result_line"] = line
    json_path.write_text(json.dumps(results, indent=1, default=float))
    val = ["| workload | mode | split | measured samples/s | predicted | error |", "|---|---|---|---|---|---|"]
    for r in results["validation"]:
        if "error" in r and "mode" not in r:
            val.append(f"| {r['error']} | | | | | |")
        else:
            val.append(f"| {r['workload']} | {r['mode']} | {r['split']} | {r['measured_sps']:.3f} | "
                       f"{r['predicted_sps']:.3f} | {r['error']:+.0%} |")
    (out / "modes_bench.md").write_text(
        f"# Schedules benchmark ({results['started']}, {results['cores']} cores, {results['elapsed_s']:.0f} s)\n\n"
        f"{table(results)}\n### simulator validation\n\n" + "\n".join(val) + f"\n\n```\n{line}\n```\n")
    plot(results, out / "modes_bench.png")
    return line
