"""Every code block of README.md and docs/**/*.md runs as a reader would run it, or says why not.

A page's blocks run in order, in one folder of their own (the page's "working directory"), as a
reader would type them into a terminal and a Python prompt:

* ``python`` blocks run in one namespace per page, in this process (so a block may use what an
  earlier one made); loaders left open are closed at the end of the page.
* ``bash`` / ``sh`` / ``shell`` blocks run with bash, ``-e``, with the virtual environment's
  ``batchd``, ``python`` and ``torchrun`` first on PATH. A ``batchd serve ...`` line starts the
  real server in the background (the rest of the block runs once it listens); it is stopped at
  the end of the page.
* ``yaml`` blocks are server configs: each is validated with ``batchd.server.config.ServerConfig``
  and becomes the page's config, which the blocks that follow use: ``batchd serve --config FILE``
  serves it (FILE is written unless a block already wrote it), and a block that names the
  config's address while no server serves the current config starts one (as a reader who
  followed Getting started has one running).

What differs from a reader's machine, and only that: every server listens on a free port of
127.0.0.1 (``--address 127.0.0.1:0``; a metrics port likewise), and the blocks that follow name the
real address where the page wrote the documented one (``127.0.0.1:50051``); ``/data/`` is a
folder of small real datasets in the layouts the pages describe (image folders, a CSV manifest,
COCO and VOC-style files made by examples/make_fashion_coco.py); Fashion-MNIST is Debian's, where
the pages say.

An HTML comment right before a fence changes what happens to it:

* ``<!-- not run: REASON -->``: not run, for the reason given (a GPU, a cluster, a package
  index, minutes of training...). Python is still compiled, shell still parsed (``bash -n``),
  YAML still parsed.
* ``<!-- file: NAME -->``: the block is written to NAME in the page's folder (a script that a
  later shell block runs, a config that ``batchd serve --config NAME`` reads); a YAML file is
  still validated and becomes the page's config.

A block whose every line is a pymdownx.snippets include (``--8<-- "path"``) shows a repository
file as it is, and is tested where that file is used. Any other block fails the test when it
fails, with the page and line.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import yaml

from batchd.server_process import ServerExited, ServerProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BIN = pathlib.Path(sys.executable).parent
DOC_ADDRESS = re.compile(r"127\.0\.0\.1:(\d+)")
LANGS = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell", "yaml": "yaml",
         "yml": "yaml"}
MARKER = re.compile(r"^<!--\s*(not run|file):\s*(.*?)\s*-->\s*$", re.S)
SNIPPET = re.compile(r'^\s*(-{1,}8<-{1,}|;?-{2}8<-{2})\s*"[^"]+"\s*$')


@dataclass
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str  # python, shell, yaml or the fence's own info word
    text: str
    marker: str = ""  # "", "not run" or "file"
    argument: str = ""  # the reason, or the file name

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a markdown page, with the marker comment right before each."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(page.read_text())
    out = []
    for i, token in enumerate(tokens):
        if token.type == "code_block" and "```" in token.content:
            raise AssertionError(f"{page.relative_to(ROOT)}:{token.map[0] + 1}: a fence inside an indented block "
                                 "(an admonition?) is not a code block for markdown; move it out")
        if token.type != "fence":
            continue
        word = (token.info.split() or [""])[0].lower()
        block = Block(page, token.map[0] + 1, LANGS.get(word, word), token.content)
        before = tokens[i - 1] if i else None
        if before is not None and before.type == "html_block" and before.map[1] == token.map[0]:
            m = MARKER.match(before.content.strip())
            if m:
                block.marker, block.argument = m.group(1), m.group(2)
        out.append(block)
    return out


def included(block: Block) -> bool:
    lines = [line for line in block.text.splitlines() if line.strip()]
    return bool(lines) and all(SNIPPET.match(line) for line in lines)


# --- the datasets under /data/ -------------------------------------------------------------------

FMNIST = pathlib.Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(scope="session")
def doc_data(tmp_path_factory) -> pathlib.Path:
    """/data/ of the pages: photos/<class>/*.jpg, pets.csv, coco/ (COCO's layout), voc/ (VOC's)."""
    import cv2
    import numpy as np

    if not (FMNIST / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist, or `make install`)")
    data = tmp_path_factory.mktemp("doc-data")
    rng = np.random.default_rng(0)
    rows = ["path,label"]
    for name in ("cat", "dog"):
        for i in range(16):
            path = data / "photos" / name / f"{i:03d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            base = rng.integers(0, 255, (1, 1, 3)) if name == "cat" else rng.integers(0, 255, (1, 1, 3)) // 2
            image = np.clip(base + rng.integers(-40, 40, (260 + 4 * i, 300, 3)), 0, 255).astype(np.uint8)
            assert cv2.imwrite(str(path), image)
            rows.append(f"photos/{name}/{i:03d}.jpg,{name}")
    (data / "pets.csv").write_text("\n".join(rows) + "\n")
    from helpers import load_example

    made = data / "fashion-coco"
    load_example("make_fashion_coco").main(["--out", str(made), "--images", "24", "--val-images", "4", "--seed", "0",
                                            "--fmnist", str(FMNIST)])
    (data / "coco" / "annotations").mkdir(parents=True)
    (data / "coco" / "train2017").symlink_to(made / "images" / "train")
    (data / "coco" / "annotations" / "instances_train2017.json").symlink_to(
        made / "annotations" / "instances_train.json")
    split = data / "voc" / "ImageSets" / "Segmentation"
    split.mkdir(parents=True)
    (data / "voc" / "JPEGImages").symlink_to(made / "images" / "train")
    (data / "voc" / "SegmentationClass").symlink_to(made / "masks" / "train")
    stems = sorted(p.stem for p in (made / "masks" / "train").glob("*.png"))
    (split / "train.txt").write_text("\n".join(stems) + "\n")
    return data


# --- a page's run ---------------------------------------------------------------------------------


@dataclass
class Server:
    process: ServerProcess
    metrics: str | None
    version: int  # the page config it serves
    command: list[str]

    @property
    def address(self) -> str:
        return self.process.address

    @property
    def log(self) -> list[str]:
        return list(self.process.lines)


class PageRun:
    """The state of one page while its blocks run: folder, config, servers, Python namespace."""

    def __init__(self, page: pathlib.Path, folder: pathlib.Path, data: pathlib.Path, cache: pathlib.Path):
        self.page, self.folder, self.data = page, folder, data
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    "XDG_CACHE_HOME": str(cache), "NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONUNBUFFERED": "1"}
        self.env.pop("BATCHD_TOKEN", None)
        self.config: dict = {}
        self.version = 0
        self.servers: dict[str, Server] = {}  # documented address -> the server answering for it
        self.metrics: dict[str, str] = {}  # documented metrics address -> the real one
        self.files: dict[str, Block] = {}  # file name -> the block written there
        self.namespace: dict = {"__name__": "__main__"}
        for name in ("examples", "deploy"):  # what the pages run from a checkout
            (folder / name).symlink_to(ROOT / name)

    # text as it runs here
    def local(self, text: str) -> str:
        text = text.replace("/data/", f"{self.data}/")
        for doc, real in {**{a: s.address for a, s in self.servers.items()}, **self.metrics}.items():
            text = text.replace(doc, real)
        return text

    def documented_address(self) -> str:
        return str(self.config.get("address", "127.0.0.1:50051"))

    def ensure_servers(self, text: str, block: Block) -> None:
        """Start (or restart, after the config changed) the server of each documented address the text names."""
        for m in DOC_ADDRESS.finditer(text):
            address = m.group(0)
            if address in self.metrics:
                continue
            server = self.servers.get(address)
            if server is not None and server.version == self.version:
                continue
            if server is None and address != self.documented_address():
                raise AssertionError(f"{block.where}: names {address}, which no server of this page serves")
            command = server.command if server is not None else ["serve", "--config", ".page-config.yaml"]
            self.serve(command, address, block)

    def serve(self, args: list[str], address: str, block: Block) -> None:
        """``batchd serve`` with ``args`` (after ``serve``) on a free port, answering for ``address``."""
        old = self.servers.pop(address, None)
        if old is not None:
            stop(old)
        config_file = self.folder / args[args.index("--config") + 1]
        if config_file.name == ".page-config.yaml" or not config_file.exists():
            config_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
        kept, i, metrics = [], 0, None
        while i < len(args):  # --address and --metrics-port become free ports here
            if args[i] in ("--address", "--metrics-port"):
                if args[i] == "--metrics-port":
                    metrics = f"127.0.0.1:{args[i + 1]}"
                i += 2
                continue
            kept.append(args[i])
            i += 1
        served = yaml.safe_load(config_file.read_text()) or {}
        if metrics is None and served.get("metrics_port"):
            metrics = f"127.0.0.1:{served['metrics_port']}"
        command = [str(BIN / "batchd"), *kept, "--address", "127.0.0.1:0"] + (["--metrics-port", "0"] if metrics else [])
        process = ServerProcess(command, cwd=self.folder, env=self.env, timeout=90, new_session=True)
        try:
            process.start()
        except (ServerExited, TimeoutError):
            process.stop(30)
            raise AssertionError(f"{block.where}: batchd serve did not start:\n{process.log[-3000:]}") from None
        found = re.search(r"serving Prometheus metrics on http://(\S+)/metrics", process.log)
        server = Server(process, found.group(1) if found else None, self.version, args)
        self.servers[address] = server
        if metrics:
            self.metrics[metrics] = server.metrics

    def run(self, block: Block) -> None:
        if block.marker == "not run":
            assert block.argument, f"{block.where}: `not run` needs a reason"
            self.check_syntax(block)
        elif block.marker == "file":
            assert re.fullmatch(r"[\w.-]+", block.argument), f"{block.where}: file: {block.argument!r}"
            self.files[block.argument] = block
            if block.lang == "yaml":
                self.take_config(block)
            self.write_file(block.argument, serve=False)
        elif block.lang == "yaml":
            self.take_config(block)
        elif block.lang == "python":
            self.run_python(block)
        elif block.lang == "shell":
            self.run_shell(block)

    def check_syntax(self, block: Block) -> None:
        if block.lang == "python":
            compile(block.text, block.where, "exec")
        elif block.lang == "shell":
            done = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
            assert done.returncode == 0, f"{block.where}: {done.stderr}"
        elif block.lang == "yaml":
            yaml.safe_load(block.text)

    def take_config(self, block: Block) -> None:
        from batchd.server.config import ServerConfig

        raw = yaml.safe_load(self.local(block.text)) or {}
        try:
            ServerConfig.model_validate(raw)
        except Exception as e:
            raise AssertionError(f"{block.where}: not a valid server config: {e}") from None
        self.config, self.version = raw, self.version + 1

    def write_file(self, name: str, *, serve: bool = True) -> None:
        """Write a file block; with ``serve``, the servers it names are started first (a script about to run)."""
        block = self.files[name]
        text = block.text.replace("/data/", f"{self.data}/")
        if block.lang != "yaml":
            if serve:
                self.ensure_servers(text, block)
            text = self.local(text)
        (self.folder / name).write_text(text)

    def run_python(self, block: Block) -> None:
        self.ensure_servers(block.text, block)
        code = compile(self.local(block.text), block.where, "exec")
        exec(code, self.namespace)  # noqa: S102  (the documentation's own example)

    def run_shell(self, block: Block) -> None:
        chunk: list[str] = []
        for line in re.sub(r"\\\n", " ", block.text).splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["batchd", "serve"]:
                self.run_chunk(chunk, block)
                chunk = []
                args = [w for w in words[1:] if w != "&"]
                given = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--address"]
                address = given[0] if given else None
                if address is None:
                    config_file = self.folder / args[args.index("--config") + 1]
                    served = yaml.safe_load(config_file.read_text()) if config_file.exists() else self.config
                    address = str((served or {}).get("address", "127.0.0.1:50051"))
                assert DOC_ADDRESS.fullmatch(address), f"{block.where}: serves {address}, not a 127.0.0.1 port"
                self.serve(args, address, block)
            else:
                chunk.append(line)
        self.run_chunk(chunk, block)

    def run_chunk(self, lines: list[str], block: Block) -> None:
        script = "\n".join(lines)
        if not script.strip():
            return
        for name in self.files:  # scripts a command may run name addresses too
            self.write_file(name)
        self.ensure_servers(script, block)
        for attempt in range(2):
            done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", self.local(script)], cwd=self.folder,
                                  env=self.env, capture_output=True, text=True, timeout=240)
            if done.returncode == 0 or not _gloo_exit_abort(script, done.stderr):
                break
        assert done.returncode == 0, (f"{block.where}: exit {done.returncode}\n{done.stdout[-3000:]}\n"
                                      f"{done.stderr[-3000:]}{self.server_logs()}")

    def server_logs(self) -> str:
        return "".join(f"\n--- server {a} ---\n" + "".join(s.log[-30:]) for a, s in self.servers.items())

    def close(self) -> None:
        for value in list(self.namespace.values()):
            if type(value).__name__ == "RemoteDataLoader":
                with contextlib.suppress(Exception):
                    value.close()
        self.namespace.clear()
        for server in self.servers.values():
            stop(server)


def stop(server: Server) -> None:
    server.process.stop(30)  # SIGTERM, then SIGKILL to its process group


# --- the tests ------------------------------------------------------------------------------------


def test_every_code_block_says_what_it_is():
    """Markers name a reason or a file; a block is Python, shell, YAML, or one of the languages
    that are not code to run (output, diagrams; a fence without a language is shown text)."""
    shown = {"", "text", "mermaid", "json", "toml", "dockerfile", "promql", "protobuf"}
    problems = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang not in ("python", "shell", "yaml") and b.lang not in shown:
                problems.append(f"{b.where}: language {b.lang!r} is neither run nor listed as shown")
            if b.marker and not b.argument:
                problems.append(f"{b.where}: `{b.marker}:` needs a reason or a file name")
    assert not problems, "\n".join(problems)
    assert sum(len(blocks(p)) for p in PAGES) > 40  # the parser still finds the blocks


@pytest.mark.timeout(420)
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_pages_code_blocks_run(page, doc_data, tmp_path, tmp_path_factory, monkeypatch):
    todo = [b for b in blocks(page) if b.lang in ("python", "shell", "yaml") and not included(b)]
    if not todo:
        pytest.skip("no code blocks")
    cache = tmp_path_factory.getbasetemp() / "doc-cache"
    cache.mkdir(exist_ok=True)
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delenv("BATCHD_TOKEN", raising=False)
    run = PageRun(page, folder, doc_data, cache)
    try:
        for b in todo:
            started = time.monotonic()
            try:
                run.run(b)
            except AssertionError:
                raise
            except Exception as e:
                raise AssertionError(f"{b.where}: {type(e).__name__}: {e}{run.server_logs()}") from e
            print(f"{b.where} {b.lang}: {b.marker or 'ran'} ({time.monotonic() - started:.1f} s)")
    finally:
        run.close()
        for name in list(sys.modules):  # the pages' own modules (mydata, myaug): fresh per page
            module = sys.modules[name]
            if getattr(module, "__file__", None) and str(folder) in str(module.__file__):
                del sys.modules[name]


def _gloo_exit_abort(script: str, stderr: str) -> bool:
    """A torchrun rank aborted at interpreter exit, after its work (gloo's runLoop thread and
    finalization: pytorch/pytorch#190489; rare since the pages free DDP first, not gone under CI
    load): tried once more. Any other failure, or this one twice, fails the test."""
    return "torchrun" in script and "terminate called without an active exception" in stderr
