"""What the README and the docs say is checked against the repository: a claim names the test that
shows it ("A claim needs a counter"), and a renamed test, option, path or figure must not leave a
page pointing at nothing. (tests/deploy/test_doc_examples.py runs the pages' code blocks;
tests/deploy/test_docs.py builds the site.)"""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [README, *DOCS]


def _defined(path: pathlib.Path) -> set[str]:
    return set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.M))


def _text(page: pathlib.Path) -> str:
    return page.read_text()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_test_a_page_names_exists(page):
    text = _text(page)
    everywhere = set().union(*(_defined(p) for p in (ROOT / "tests").rglob("test_*.py")))
    missing = []
    for m in re.finditer(r"`(tests/[\w/]+\.py)(?:::(\w+))?", text):
        path = ROOT / m.group(1)
        if not path.exists():
            missing.append(m.group(1))
        elif m.group(2) and m.group(2) not in _defined(path):
            missing.append(f"{m.group(1)}::{m.group(2)}")
    # "`::name`" continues the file named before it: at least the test must exist somewhere
    missing += [f"::{name}" for name in re.findall(r"`::(\w+)", text) if name not in everywhere]
    assert not missing, f"{page.relative_to(ROOT)} names tests that do not exist: {missing}"


def test_the_pages_name_tests_at_all():
    """The pattern above still finds the references (a page rewritten without them would pass)."""
    assert len(re.findall(r"`tests/[\w/]+\.py", _text(README))) >= 10
    assert sum(len(re.findall(r"`tests/[\w/]+\.py", _text(p))) for p in DOCS) > 60


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 400, f"README.md has {lines} lines; the rest belongs in docs/"


def test_the_readmes_first_two_commands_run_the_demo_then_the_tests_as_ci_does():
    fence = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in fence.splitlines() if line.split("#")[0].strip()]
    assert commands[:2] == ["make demo", "make test"], commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-2:] == ["make test", "make test-containers"], ci  # then the Compose stacks in a real engine


def test_every_extra_the_pages_name_exists():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set()
    for page in PAGES:
        for group in re.findall(r"(?:batchd|\.)\[([\w,\s-]+)\]", _text(page)):
            named |= {e.strip() for e in group.split(",")}
        named |= set(re.findall(r"`\[([\w-]+)\]`", _text(page)))
    assert named, "the pattern finds no extra"
    assert named <= extras, f"extras the pages name that pyproject.toml does not define: {sorted(named - extras)}"


def test_every_repository_path_the_pages_name_exists():
    pattern = r"`((?:server|client|batchd|bench|examples|deploy|proto|tests|docs)/[\w./-]+\.(?:py|yaml|yml|proto|md|json|png))"
    missing = []
    for page in PAGES:
        for path in re.findall(pattern, _text(page)):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_the_readmes_links_lead_somewhere():
    missing = [link for link in re.findall(r"\]\(((?!https?:|#)[^)#]+)(?:#[^)]*)?\)", README.read_text())
               if not (ROOT / link).exists()]
    assert not missing, missing


# --- figures: one source -------------------------------------------------------------------------


def test_the_figures_come_from_bench_results():
    """The fragments the docs include are what bench/fragments.py makes of results.json now, and
    the README's headline block is the headline fragment (``python -m bench.fragments`` rewrites both)."""
    from bench import fragments, report
    from bench.run_all import MODULES

    out = ROOT / "bench" / "results"
    expected = fragments.render_all(report.load(out), MODULES, fragments.fallback_machine(out))
    folder = out / "fragments"
    stale = [name for name, text in expected.items()
             if not (folder / name).exists() or (folder / name).read_text() != text]
    assert not stale, f"bench/results/fragments is stale ({stale}): run python -m bench.fragments"
    assert fragments.readme_block(expected["headline.md"]) in README.read_text(), \
        "README.md's headline block is not bench/results/fragments/headline.md: run python -m bench.fragments"
    for page in DOCS:  # every include names a fragment that exists (mkdocs --strict checks it too)
        for name in re.findall(r'--8<-- "bench/results/fragments/([\w.]+)"', _text(page)):
            assert name in expected, f"{page.relative_to(ROOT)} includes {name}, which no table makes"


def test_the_pages_retype_no_benchmark_table():
    """A figure of a table appears once, in its fragment: no page carries a table row of results."""
    for page in PAGES:
        rows = re.findall(r"^\|.*\d+(?:\.\d+)?x.*\|$", _text(page), re.M)
        inside = README.read_text().split("<!-- headline -->")[1].split("<!-- /headline -->")[0] if page == README else ""
        rows = [r for r in rows if r not in inside]
        assert not rows, f"{page.relative_to(ROOT)} retypes benchmark rows: {rows[:3]}"


# a measured figure: two decimals or more, alone or in a run ("0.46 -> 0.84 ms", "0.27 / 0.19 s"),
# with or without its unit; settings and targets ("0.2 s/GB", "5 ms") have fewer decimals
_FIGURE = re.compile(r"(?<![\w.])\d+\.\d{2,}(?:\s*(?:->|→|-|/)\s*\d+(?:\.\d+)?)*"
                     r"(?:\s*(?:ms|s/GB|s|img/s|images/s|x|%))?(?!\w|\.\d)")
_DATED = re.compile(r"\bTable \d+\b|\b20\d\d-\d\d-\d\d\b")


def test_the_pages_retype_no_dated_figure_in_prose():
    """A paragraph that points at a table (or gives a date) says what it shows in words, and leaves
    the figures to the table's fragment: a figure typed beside "Table 18" is stale after the next run."""
    for page in PAGES:
        text = re.sub(r"```.*?```", "", _text(page), flags=re.S)
        text = re.sub(r"<!-- headline -->.*?<!-- /headline -->", "", text, flags=re.S)
        found = [(_DATED.search(para).group(0), _FIGURE.findall(para)[:4])
                 for para in re.split(r"\n\s*\n", text) if _DATED.search(para) and _FIGURE.search(para)]
        assert not found, f"{page.relative_to(ROOT)} retypes figures next to a table or date: {found[:3]}"


def test_the_dated_figure_pattern_finds_retyped_figures():
    """The patterns above still catch what they are for (a rewrite could make them match nothing)."""
    para = "Table 18 (2026-11-27): relay 0.27 / 0.19 / 0.13 s, trainer 0.46 -> 0.84 ms at 50/s, 6.58 ms."
    assert _DATED.search(para)
    assert _FIGURE.findall(para) == ["0.27 / 0.19 / 0.13 s", "0.46 -> 0.84 ms", "6.58 ms"]
    assert not _FIGURE.search("the 0.2 s/GB goal, a grant waits up to 5 ms, torch 2.13.0, 1.5x")


# --- facts checked against the code ---------------------------------------------------------------


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def test_the_api_page_gives_every_constructor_argument():
    import batchd

    table = _section((ROOT / "docs" / "api.md").read_text(), "## The arguments")
    named = set(re.findall(r"^\| `(\w+)`|, `(\w+)`", table, re.M))
    named = {a or b for a, b in named}
    arguments = set(inspect.signature(batchd.RemoteDataLoader.__init__).parameters) - {"self"}
    assert arguments <= named, f"docs/api.md's table lacks {sorted(arguments - named)}"
    assert named <= arguments, f"docs/api.md's table names what RemoteDataLoader does not take: {sorted(named - arguments)}"


def test_the_config_reference_gives_every_server_option():
    from batchd.server.config import ServerConfig

    block = re.search(r"## Server config reference.*?```yaml\n(.*?)```", (ROOT / "docs" / "deployment.md").read_text(),
                      re.S).group(1)
    keys = set(yaml.safe_load(block))
    fields = set(ServerConfig.model_fields) - {"also_listen"}  # (the reference lists addresses as a list)
    assert fields <= keys, f"docs/deployment.md's reference lacks {sorted(fields - keys)}"
    assert keys <= fields, f"docs/deployment.md's reference has unknown options {sorted(keys - fields)}"


def test_the_allowlist_on_the_pipelines_page_is_the_servers():
    from batchd.server.compute.allowlist import ALLOWED

    text = (ROOT / "docs" / "pipelines.md").read_text()
    listed = set(re.findall(r"`(\w+)`", text.split("<!-- allowlist -->")[1].split("<!-- /allowlist -->")[0]))
    assert listed == set(ALLOWED), f"missing {sorted(set(ALLOWED) - listed)}; not allowed {sorted(listed - set(ALLOWED))}"


def test_every_metric_the_tuning_page_names_is_exported():
    source = (ROOT / "server" / "serve" / "metrics.py").read_text()
    exported = set(re.findall(r'"(batchd_\w+)"', source))
    named = set(re.findall(r"`(batchd_\w+?)(?:\{[^}]*\})?`", (ROOT / "docs" / "tuning.md").read_text()))
    assert len(named) > 30
    unknown = sorted(m for m in named if m not in exported and m.removesuffix("_total") not in exported)
    assert not unknown, f"docs/tuning.md names metrics the server does not export: {unknown}"


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "deployment.md"], ids=["README.md", "docs/deployment.md"])
def test_the_compose_excerpt_is_the_compose_file(page):
    """Every value the excerpt shows is the one docker-compose.yml has at that place."""
    excerpt = next(yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)
                   if block.startswith("services:"))
    real = yaml.safe_load((ROOT / "docker-compose.yml").read_text())

    def check(shown, actual, where):
        if isinstance(shown, dict):
            assert isinstance(actual, dict), where
            for key, value in shown.items():
                assert key in actual, f"{where}.{key} is not in docker-compose.yml"
                check(value, actual[key], f"{where}.{key}")
        else:
            assert shown == actual, f"{where}: {shown!r} vs docker-compose.yml's {actual!r}"

    check(excerpt, real, "compose")


def test_every_profile_verdict_has_a_section_to_link_to():
    from batchd.client.loader.profile import VERDICTS

    text = (ROOT / "docs" / "tuning.md").read_text()
    missing = [v for v in VERDICTS if not re.search(rf"^### {v} \{{#{v}\}}$", text, re.M)]
    assert not missing, f"docs/tuning.md has no section (anchor) for {missing}"


def test_every_verdicts_advice_links_to_its_section_on_the_docs_site():
    """The advice ends with the address of its verdict's section (``batchd.links.DOCS_URL``, the
    site_url mkdocs.yml builds the site for) and that section's anchor exists in docs/tuning.md."""
    from batchd.client.loader.profile import ADVICE, VERDICTS
    from batchd.links import DOCS_URL

    assert yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python/name:", ""))["site_url"] == DOCS_URL
    text = (ROOT / "docs" / "tuning.md").read_text()
    for verdict in VERDICTS:
        link = re.search(r"See (\S+)\.$", ADVICE[verdict])
        assert link, f"the advice of {verdict} names no address: {ADVICE[verdict]!r}"
        page, _, anchor = link.group(1).removeprefix(DOCS_URL).partition("/#")
        assert (page, anchor) == ("tuning", verdict), link.group(1)
        assert re.search(rf"^### .* \{{#{anchor}\}}$", text, re.M), f"docs/tuning.md has no anchor #{anchor}"
