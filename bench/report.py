"""results.json (every table's raw numbers) -> results.md (markdown tables + PASS/FAIL targets).

Each run replaces the tables it ran and keeps the others (``--only`` re-runs part of the
suite); every table records when it ran and whether it was a --quick run.
"""

from __future__ import annotations

import json
import pathlib
from typing import Sequence


def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def fx(x: float, digits: int = 2) -> str:
    """A ratio as '1.23x'."""
    return f"{x:.{digits}f}x"


def load(out_dir: pathlib.Path) -> dict:
    try:
        return json.loads((out_dir / "results.json").read_text())
    except (OSError, ValueError):
        return {}


def save(out_dir: pathlib.Path, results: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    tmp.replace(out_dir / "results.json")


def noise_note(r: dict) -> str:
    """How loaded the shared machine was while the table ran."""
    out = f"{r['seconds']:.0f} s"
    if "foreign_cpu" in r:
        out += f"; other processes used at least {r['foreign_cpu']:.0%} of the machine's CPU during the table"
    g = r.get("guard")
    if g and g["measurements"]:
        out += (f"; during the {g['measurements']} measurements: median {g['foreign_median']:.0%}, max "
                f"{g['foreign_max']:.0%} ({g['retried']} re-measured, {g['guard_s']:.0f} s spent waiting/retrying)")
    return out


def target_line(t: dict) -> str:
    verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["passed"]]
    return f"- **{verdict}** {t['name']}: {t['detail']}"


def render(results: dict, modules: Sequence, machine_md: str, wall: dict) -> str:
    parts = ["# batchd benchmarks", "", machine_md, ""]
    if wall:
        parts += ["- wall time of this run: " + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items()), ""]
    parts += [
        "Produced by `python -m bench.run_all` (`make bench`). Each number is the median of the "
        "repeats stated under its table; the machine is shared and noisy, so compare numbers within a "
        "table (measured in the same minutes, interleaved) rather than across runs.",
        "",
        "## Targets",
        "",
    ]
    for m in modules:
        if m.NAME in results:
            try:
                parts += [target_line(t) for t in m.targets(results[m.NAME])]
            except (KeyError, TypeError, ValueError):
                parts += [target_line({"passed": None, "name": m.TITLE, "detail": "stored results are stale"})]
        else:
            parts += [target_line({"passed": None, "name": m.TITLE, "detail": "not run"})]
    parts.append("")
    for m in modules:
        r = results.get(m.NAME)
        if r is None:
            continue
        stamp = f"_run {r['run_at']}{' (--quick: fewer images and repeats)' if r.get('quick') else ''}: {noise_note(r)}"
        try:
            body = m.render(r)
        except (KeyError, TypeError, ValueError) as e:  # results.json from an older version of the table
            body = f"(cannot render these stored results: {type(e).__name__}: {e}; run this table again)"
        parts += [f"## {m.TITLE}", "", stamp + "_", "", body, ""]
    return "\n".join(parts)


def write(out_dir: pathlib.Path, text: str) -> pathlib.Path:
    path = out_dir / "results.md"
    tmp = out_dir / "results.md.tmp"
    tmp.write_text(text)
    tmp.replace(path)
    return path
