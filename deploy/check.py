"""``make deploy-check``: the Prometheus scrape config and the Grafana dashboard, checked with a real
Prometheus against a short real run.

::

    promtool check config deploy/prometheus/prometheus.yml      (the shipped file, as users get it)
    prometheus (127.0.0.1:free port, temp storage, 1 s scrapes) <── file_sd: TMP/sd/*.json
         ^ scrapes                                                        ^ writes (metrics.sd_dir)
    hflow-async --preset tiny (short fully-async run) ─────────────────────┘
    then, through Prometheus' HTTP API (/api/v1/...):
      * the job's target was up, labelled with its run name (found by file_sd, not by a fixed address);
      * every hflow_* series the job exports (controller/metrics.py) was scraped;
      * every query of every panel of deploy/grafana/hflow.json names only exported series and returns
        data (a finite value) over the run's time range, as Grafana would ask for it (query_range).

Exits 0 when all hold, 1 with one line per failure otherwise, 2 when Prometheus is not installed.
``--png PATH`` also draws each panel from the query results (matplotlib; the README's dashboard image).
Nothing listens beyond 127.0.0.1; everything is removed afterwards (``--keep`` keeps the temp dir).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "hflow.json"
RATE_INTERVAL = "10s"  # what the check puts for Grafana's $__rate_interval (>= 4 scrapes of 1 s apart)
SERIES_NAME = re.compile(r"\bhflow_[A-Za-z0-9_]+")
VARIABLE = re.compile(r"\$\{?(\w+)\}?")


class CheckFailed(Exception):
    """A step of the check failed; the message says which and why."""


# ------------------------------------------------------------------------------ what the job exports


def exported_series() -> set[str]:
    """Every sample name the job's endpoint can serve: a counter ``c`` as ``c_total``, a histogram ``h``
    as ``h_bucket``/``h_sum``/``h_count``, a gauge under its own name (``_created`` series left out)."""
    sys.path.insert(0, str(REPO))
    from controller.metrics import JobMetrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = set()
    for family in JobMetrics().registry.collect():
        if family.type not in suffixes:
            raise CheckFailed(f"series {family.name}: type {family.type} is not one the check knows")
        names.update(family.name + s for s in suffixes[family.type])
    return names


# -------------------------------------------------------------------------------------- the dashboard


def dashboard_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """``(panel title, refId, expr)`` of every query of every panel (rows' nested panels included).
    Raises CheckFailed for a panel without queries or a query without an expression."""
    out = []
    panels = [p for top in dashboard.get("panels", []) for p in [top, *top.get("panels", [])]]
    for panel in panels:
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        if not targets:
            raise CheckFailed(f"panel {panel.get('title')!r} has no query")
        for target in targets:
            expr = target.get("expr", "")
            if not expr.strip():
                raise CheckFailed(f"panel {panel.get('title')!r} query {target.get('refId')} has no expr")
            out.append((panel["title"], target["refId"], expr))
    return out


def expand(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with Grafana's ``$name`` / ``${name}`` replaced from ``variables``; CheckFailed naming a
    variable that is not there."""
    def sub(m: re.Match) -> str:
        if m[1] not in variables:
            raise CheckFailed(f"query {expr!r} uses ${m[1]}, which the check cannot fill in ({sorted(variables)})")
        return variables[m[1]]

    return VARIABLE.sub(sub, expr)


def unknown_series(queries: list[tuple[str, str, str]], exported: set[str]) -> list[str]:
    """One line per query that names a series the job does not export, or no hflow_* series at all."""
    problems = []
    for title, ref, expr in queries:
        names = set(SERIES_NAME.findall(expr))
        if not names:
            problems.append(f"panel {title!r} query {ref}: names no hflow_* series: {expr}")
        for name in sorted(names - exported):
            problems.append(f"panel {title!r} query {ref}: {name} is not a series the job exports")
    return problems


# ------------------------------------------------------------------------------------------ Prometheus


def check_config(promtool: str, path: Path) -> None:
    """``promtool check config path``; CheckFailed with its output when it rejects the file."""
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise CheckFailed(f"promtool check config {path}: {(done.stdout + done.stderr).strip()}")


def derive_config(shipped: dict, sd_dir: Path, scrape_interval_s: int) -> dict:
    """The shipped config with the check's own file_sd directory and a short scrape interval; everything
    else (jobs, relabelling) as shipped, so the check scrapes through what users deploy."""
    config = json.loads(json.dumps(shipped))  # a deep copy
    config.setdefault("global", {}).update(scrape_interval=f"{scrape_interval_s}s",
                                           scrape_timeout=f"{scrape_interval_s}s", evaluation_interval="1s")
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [str(sd_dir / "*.json")]
            sd["refresh_interval"] = "2s"
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server on 127.0.0.1 (a free port) with its storage in ``work``; ``api`` queries it."""

    def __init__(self, binary: str, config: Path, work: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "prometheus.log"
        cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CheckFailed(f"prometheus exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise CheckFailed(f"prometheus not ready after {timeout_s} s: {self.log.read_text()[-2000:]}")

    def api(self, path: str, **params) -> dict | list:
        """``GET /api/v1/<path>?params``'s ``data``; CheckFailed when the status is not success."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as err:
            body = json.loads(err.read() or b"{}")
        if body.get("status") != "success":
            raise CheckFailed(f"prometheus /api/v1/{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


# ------------------------------------------------------------------------------------------- the run


def job_command(run_dir: Path, sd_dir: Path, num_steps: int) -> list[str]:
    """The short run: the tiny preset, fully-async (every stage, every series, validation rounds included),
    ``num_steps`` steps."""
    return [sys.executable, "-m", "controller.cli", "--preset", "tiny", "--mode", "fully-async",
            f"trainer.total_steps={num_steps}", f"run_dir={run_dir}", f"metrics.sd_dir={sd_dir}",
            "metrics.progress=false", "data.val_size=4", "val.n=2", "trainer.val_every=4",
            "data.val_disjoint=false"]  # tiny_repeat's few prompts all train: its validation repeats them


def run_job(prom: Prometheus, run_dir: Path, sd_dir: Path, num_steps: int, timeout_s: float) -> int:
    """Run the job and wait for it; returns how many scrapes of it Prometheus recorded as up (the job's
    target was found by file_sd and labelled with the run's name). CheckFailed when it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log = run_dir.parent / "job.log"
    with open(log, "wb") as out:
        done = subprocess.run(job_command(run_dir, sd_dir, num_steps), stdout=out, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO, timeout=timeout_s)
    if done.returncode != 0:
        raise CheckFailed(f"the run exited with {done.returncode}: {log.read_text()[-3000:]}")
    time.sleep(2)  # the last scrapes land
    up = prom.api("query", query=f'count_over_time(up{{job="hflow", run="{run_dir.name}"}}[1h])')
    num_up = int(float(up["result"][0]["value"][1])) if up["result"] else 0
    if num_up < 3:
        raise CheckFailed(f"Prometheus scraped the run {num_up} times (file_sd {sd_dir}); want >= 3: "
                          f"{prom.log.read_text()[-2000:]}")
    return num_up


def check_series(prom: Prometheus, run: str, exported: set[str], start: float, end: float) -> list[str]:
    """One line per exported series Prometheus has no sample of from the run (``/api/v1/series``)."""
    found = prom.api("series", **{"match[]": f'{{__name__=~"hflow_.+", run="{run}"}}'}, start=start, end=end)
    names = {s["__name__"] for s in found}
    return [f"series {name} was not scraped from the run" for name in sorted(exported - names)]


def check_panels(prom: Prometheus, queries, run: str, start: float, end: float) -> tuple[list[str], dict]:
    """Run every panel query over ``[start, end]`` (1 s steps); one line per query with no finite value,
    and the results by (title, refId) for drawing."""
    problems, results = [], {}
    variables = {"run": run, "__rate_interval": RATE_INTERVAL, "datasource": "prometheus"}
    for title, ref, expr in queries:
        data = prom.api("query_range", query=expand(expr, variables), start=start, end=end, step="1s")
        series = [(s["metric"], [(float(t), float(v)) for t, v in s["values"]]) for s in data["result"]]
        if not any(math.isfinite(v) for _, values in series for _, v in values):
            problems.append(f"panel {title!r} query {ref} returned no data: {expr}")
        results[(title, ref)] = series
    return problems, results


def draw(dashboard: dict, results: dict, path: Path, start: float, end: float) -> None:
    """Each panel's query results as a matplotlib subplot; saved to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(15, 2.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            for metric, values in results.get((panel["title"], target["refId"]), []):
                label = re.sub(r"\{\{(\w+)\}\}", lambda m, metric=metric: metric.get(m[1], ""), target.get("legendFormat", ""))
                ax.plot([t - start for t, _ in values], [v for _, v in values], label=label or target["refId"], lw=1)
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlim(0, end - start)
        ax.tick_params(labelsize=7)
        if len(ax.get_legend_handles_labels()[0]) <= 8:
            ax.legend(fontsize=6, loc="best")
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.supxlabel("seconds since the run started", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- main


def run_check(args: argparse.Namespace, work: Path, binaries: tuple[str, str]) -> list[str]:
    """The check in ``work``; the list of failures (empty: passed)."""
    prometheus, promtool = binaries
    check_config(promtool, PROMETHEUS_CONFIG)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    exported = exported_series()
    problems = unknown_series(queries, exported)
    sd_dir, run_dir = work / "sd", work / "hflow-deploy-check"
    sd_dir.mkdir()
    config = work / "prometheus.yml"
    config.write_text(yaml.safe_dump(derive_config(yaml.safe_load(PROMETHEUS_CONFIG.read_text()), sd_dir, 1)))
    check_config(promtool, config)
    prom = Prometheus(prometheus, config, work)
    try:
        prom.wait_ready()
        start = time.time()
        num_up = run_job(prom, run_dir, sd_dir, args.steps, args.timeout)
        end = time.time()
        print(f"deploy-check: the run took {end - start:.0f} s; Prometheus scraped it {num_up} times", flush=True)
        problems += check_series(prom, run_dir.name, exported, start, end)
        panel_problems, results = check_panels(prom, queries, run_dir.name, start, end)
        problems += panel_problems
        if args.png:
            draw(dashboard, results, Path(args.png), start, end)
            print(f"deploy-check: dashboard drawn in {args.png}")
    finally:
        prom.stop()
    print(f"deploy-check: {len(queries)} dashboard queries, {len(exported)} exported series checked")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="trainer steps of the short run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the run may take")
    parser.add_argument("--png", help="also draw the dashboard's panels from the run into this PNG file")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, Prometheus data)")
    args = parser.parse_args(argv)
    binaries = shutil.which("prometheus"), shutil.which("promtool")
    if not all(binaries):
        print("deploy-check: needs Prometheus (prometheus and promtool on PATH): "
              "`make deploy-check` unpacks Debian's package into .cache/prometheus", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="hflow-deploy-check-"))
    try:
        problems = run_check(args, work, binaries)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        problems = [str(exc)]
    finally:
        if args.keep:
            print(f"deploy-check: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for line in problems:
        print(f"deploy-check: FAILED: {line}", file=sys.stderr)
    print("deploy-check: " + ("passed" if not problems else f"{len(problems)} failure(s)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
