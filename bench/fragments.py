"""results.json -> bench/results/fragments/*.md: the pieces the docs include, so every figure has one source.

    python -m bench.fragments        # rewrite the fragments and the README's headline block from results.json

``run_all`` writes them after every run too. The docs site includes them with pymdownx.snippets
(``--8<-- "bench/results/fragments/table1.md"``); GitHub cannot include files, so the README holds
a copy of ``headline.md`` between ``<!-- headline -->`` and ``<!-- /headline -->``, which
``sync_readme`` rewrites (tests/deploy/test_readme.py checks that the copy and the fragments are
current).

Probes outside the numbered tables that keep their figures in results.json too (``PROBES``:
``python -m bench.probes.batch_rate``, ``python -m bench.probes.in_band``) get a fragment the same way, named after the probe.

Each table's fragment starts with its caption: the title, when and on which machine it ran, the
script that measures it and how busy the shared machine was; the table follows as results.md
shows it.
"""

from __future__ import annotations

import datetime
import pathlib
import re
import sys
from typing import Sequence

from bench import ROOT

README = ROOT / "README.md"
BEGIN, END = "<!-- headline -->", "<!-- /headline -->"

# (table, the start of one of its targets' names, what the headline row says)
HEADLINE = (
    ("table1", "batchd shm >= 1.0x DataLoader images/s (L3", "photos, 2 workers: batchd over shared memory vs PyTorch DataLoader"),
    ("table3", "overlap: per-step time", "a training step beside loading: step time / max(load time, step alone), 2 workers"),
    ("table9", "batchd (2 workers) at 50 ms per open", "50 ms of storage latency per file: images/s kept"),
    ("table10", "cache in RAM", "decoded-sample cache in RAM: epochs 2-3 vs epoch 1"),
    ("table13", "batchd shm, no cache >= 1.0x DataLoader images/s (COCO", "COCO boxes + masks: batchd vs PyTorch DataLoader"),
    ("table6", "2 servers (1 worker each)", "one loader over 2 servers vs 1 (1 worker each)"),
    ("table17", "3 servers (128 + 47 + 80 img/s): one loader", "servers of unequal speed in one loader vs the sum of each alone"),
    ("table17", "sidecar (1 worker, 8 ms per batch) + pool (4 workers, 800 ms",
     "a fast sidecar beside a slow 4-worker pool (8 and 200 ms per batch alone): together vs the sum, per run"),
    ("table18", "data plane (relay): trainer CPU", "a remote trainer's CPU per GB received (relay; others in brackets)"),
    ("table20", "batchd >= 1.3x a DataLoader running the same albumentations pipeline (large photos",
     "large photos, RandomResizedCrop(224) + flip, 2 workers: batchd vs PyTorch DataLoader"),
    ("table16", "server main process <= 1 ms", "server main process CPU per batch (shared memory, batch 64 / 256)"),
    ("table22", "control path from outside (psutil): server main process",
     "server main process CPU per batch from outside (psutil; batch x batches per epoch)"),
)


def probes() -> tuple:
    """The probes (bench/probes/) whose figures results.json keeps under their ``NAME``: each has
    ``NAME``, ``TITLE``, ``render(r)`` and ``targets(r)`` as a table module has."""
    from bench.probes import batch_rate, in_band

    return (batch_rate, in_band)


def when(r: dict) -> str:
    """A table's run time as 'YYYY-MM-DD HH:MM UTC'."""
    t = datetime.datetime.fromisoformat(r["run_at"]).astimezone(datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M UTC")


def machine_of(r: dict, fallback: str) -> str:
    """The machine a table ran on: recorded with it (``machine``, run_all), else ``fallback``."""
    return r.get("machine") or fallback


def machine_line(info: dict) -> str:
    """``bench.machine.info()`` in a few words, for captions."""
    return f"{info['cpus']} CPUs ({info['cpu_model']}), {info['memory']} RAM, torch {info['torch']}, OpenCV {info['opencv']}"


def fallback_machine(out_dir: pathlib.Path) -> str:
    """The machine of results.md's header (tables run before captions recorded their own)."""
    try:
        text = (out_dir / "results.md").read_text()
    except OSError:
        return "machine not recorded"
    m = re.search(r"^- machine: (.+?)(?:; load average.*)?$", text, re.M)
    if not m:
        return "machine not recorded"
    # in machine_line's words (CPUs, RAM, torch, OpenCV), so one machine is not named twice
    machine = re.sub(r", Linux [^,;]*", "", m.group(1))
    soft = re.search(r"^- software: .*?(torch [^,]+), (OpenCV [^,]+)", text, re.M)
    return f"{machine}, {soft.group(1)}, {soft.group(2)}" if soft else machine


def script(module) -> str:
    return module.__name__.replace(".", "/") + ".py"


def caption(module, r: dict, machine: str) -> str:
    from bench import report

    quick = " (--quick: fewer images and repeats)" if r.get("quick") else ""
    return (f"**{module.TITLE}.** Measured {when(r)}{quick} on {machine}; `{script(module)}`; "
            f"{report.noise_note(r)}.")


def table(module, r: dict, machine: str) -> str:
    try:
        body = module.render(r)
    except (KeyError, TypeError, ValueError) as e:  # results.json from an older version of the table
        body = f"(cannot render these stored results: {type(e).__name__}: {e}; run this table again)"
    return f"{caption(module, r, machine)}\n\n{body}\n"


def targets(results: dict, modules: Sequence) -> str:
    from bench import report

    lines = []
    for m in modules:
        if m.NAME not in results:
            continue
        try:
            lines += [report.target_line(t) + f" ({m.TITLE.split(':')[0]}, {when(results[m.NAME])})"
                      for t in m.targets(results[m.NAME])]
        except (KeyError, TypeError, ValueError):
            lines.append(report.target_line({"passed": None, "name": m.TITLE, "detail": "stored results are stale"}))
    return "\n".join(lines) + "\n"


def headline(results: dict, modules: Sequence, fallback: str) -> str:
    """A few figures from the targets of some tables, one row each, with their date and table."""
    by_name = {m.NAME: m for m in modules}
    rows, machines = [], set()
    for name, start, what in HEADLINE:
        m, r = by_name.get(name), results.get(name)
        if m is None or r is None:
            continue
        try:
            found = [t for t in m.targets(r) if t["name"].startswith(start)]
        except (KeyError, TypeError, ValueError):
            found = []
        if not found:
            continue
        detail = found[0]["detail"].replace("|", "/")
        rows.append(f"| {what} | {detail} | {m.TITLE.split(':')[0]}, {when(r)[:10]} |")
        machines.add(machine_of(r, fallback))
    head = (f"Measured on {'; '.join(sorted(machines))}, a shared machine, so compare within a table; "
            "`make bench` measures them again (every table: `bench/results/results.md`).")
    return "\n".join([head, "", "| what | measured | source |", "|---|---|---|", *rows]) + "\n"


def render_all(results: dict, modules: Sequence, fallback: str) -> dict[str, str]:
    """file name -> text of every fragment: the tables', the probes' (``probes()``), targets, headline."""
    out = {f"{m.NAME}.md": table(m, results[m.NAME], machine_of(results[m.NAME], fallback))
           for m in (*modules, *probes()) if m.NAME in results}
    out["targets.md"] = targets(results, modules)
    out["headline.md"] = headline(results, modules, fallback)
    return out


def write(out_dir: pathlib.Path, results: dict, modules: Sequence) -> pathlib.Path:
    """Write every fragment under ``out_dir/fragments`` (a fragment no table makes any more is removed)."""
    folder = out_dir / "fragments"
    folder.mkdir(parents=True, exist_ok=True)
    texts = render_all(results, modules, fallback_machine(out_dir))
    for path in folder.glob("*.md"):
        if path.name not in texts:
            path.unlink()
    for name, text in texts.items():
        path = folder / name
        if not path.exists() or path.read_text() != text:
            tmp = path.with_name(name + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)
    return folder


def keep_probe(out_dir: pathlib.Path, name: str, r: dict, *, seconds: float, foreign_cpu_s: float,
               quick: bool = False) -> pathlib.Path:
    """A probe's result ``r`` stamped (when, how long in seconds, other processes' share of the
    machine's CPU from ``foreign_cpu_s`` seconds, the machine), kept in ``out_dir``'s results.json
    under ``name``, and every fragment rewritten; returns the fragments' folder."""
    import os

    from bench import machine, report
    from bench.run_all import MODULES

    r.update(run_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), quick=quick, seconds=seconds,
             foreign_cpu=foreign_cpu_s / (seconds * (os.cpu_count() or 1)), machine=machine_line(machine.info()))
    results = report.load(out_dir)
    results[name] = r
    report.save(out_dir, results)
    return write(out_dir, results, MODULES)


def readme_block(text: str) -> str:
    """The README's headline block as it should read: the fragment between the markers."""
    return f"{BEGIN}\n{text}{END}"


def sync_readme(headline_text: str, readme: pathlib.Path = README) -> bool:
    """Put ``headline_text`` between the README's markers; True if the README changed."""
    text = readme.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{readme} has no {BEGIN} ... {END} block")
    new = pattern.sub(lambda _: readme_block(headline_text), text, count=1)
    if new != text:
        readme.write_text(new)
    return new != text


def main() -> int:
    from bench import report
    from bench.run_all import MODULES

    out = ROOT / "bench" / "results"
    folder = write(out, report.load(out), MODULES)
    changed = sync_readme((folder / "headline.md").read_text())
    print(f"wrote {folder}" + ("; updated README.md's headline block" if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
