"""Operator-side Python pipelines: presets that name a callable in the server's environment.

Config::

    pipelines:
      mine: {python: "mypkg.aug:make_train", args: {size: 224}}

``make_train(**args)`` returns ``fn(sample: dict, rng: numpy.random.Generator) -> dict``; a worker
builds it once and calls it on each sample with ``rng`` the sample's own stream
(``pipeline.SampleRandom.generator``, re-keyed to (seed, epoch, position) before each sample), so
the randomness stays keyed per sample whatever the workers. Python's ``random``, numpy's global
generator and torch's default one are seeded from (seed, epoch, position) around each call and
restored afterwards (``run_keyed``; as around a ``kind: python`` ``__getitem__``), so a preset
whose torchvision transforms draw from torch's global generator is keyed as well. The returned
dict is the sample as it goes into the batch (any fields; README "Samples and targets").

No client code runs on the server: a stream carries such a pipeline as ``preset_json`` (a JSON
object whose only key is ``MARKER``), and a worker runs only the presets of the server's own
config, looked up by name (``build(text, presets)``). A client may name the preset; a client
that sends a pipeline of its own is held to the albumentations allowlist, which refuses any
top-level field but ``transform`` and ``__version__`` (tests/compute/test_python_pipeline.py).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from batchd.server.data.datasets._keyed import PIPELINE, keyed_run
from batchd.server.data.datasets.python import import_factory

MARKER = "batchd_python"

SampleFn = Callable[[dict, np.random.Generator], dict]


def preset_json(name: str, spec: dict[str, Any]) -> str:
    """The canonical JSON a stream carries for python preset ``name`` ({python, args} from the config)."""
    body = {"preset": name, "python": spec["python"], "args": spec.get("args") or {}}
    return json.dumps({MARKER: body}, sort_keys=True, separators=(",", ":"), default=str)


def is_python(pipeline_json: str) -> bool:
    """True for the JSON of a python preset (``preset_json``)."""
    return pipeline_json.startswith('{"' + MARKER + '":')


def build(pipeline_json: str, presets: dict[str, dict[str, Any]]) -> SampleFn:
    """The per-sample function of the python preset ``pipeline_json`` names, from ``presets`` (the
    server config's python presets: name -> {python, args}). Raises ValueError if the name is not
    one of them or its spec differs from the config's; whatever importing or calling the factory
    raises; TypeError if it does not return a callable."""
    body = json.loads(pipeline_json)[MARKER]
    name = body.get("preset")
    spec = presets.get(name)
    if spec is None or preset_json(name, spec) != pipeline_json:
        raise ValueError(f"python pipeline {name!r} is not a preset of this server's config")
    return make(spec, name)


def make(spec: dict[str, Any], name: str) -> SampleFn:
    """Import ``spec["python"]`` and call it with ``spec["args"]``; raises its errors, with a note naming the preset."""
    try:
        factory = import_factory(spec["python"])
        fn = factory(**(spec.get("args") or {}))
    except Exception as e:
        e.add_note(f"while building python pipeline {name!r}: {spec['python']}(**{spec.get('args') or {}!r})")
        raise
    if not callable(fn):
        raise TypeError(f"python pipeline {name!r}: {spec['python']}(...) returned a {type(fn).__name__}, not a "
                        "function fn(sample: dict, rng: numpy.random.Generator) -> dict")
    return fn


def run(fn: SampleFn, sample: dict, rng: np.random.Generator) -> dict:
    """``fn(sample, rng)``; raises TypeError unless it returns a dict."""
    out = fn(sample, rng)
    if not isinstance(out, dict):
        raise TypeError(f"the python pipeline returned a {type(out).__name__}, not a dict of fields")
    return out


def run_keyed(fn: SampleFn, sample: dict, random: Any, key: np.ndarray, position: int) -> dict:
    """``run(fn, sample, rng)`` with ``rng`` the sample's stream (``random``, the worker's
    ``pipeline.SampleRandom``, started at (``key``, ``position``)) and the global generators
    seeded for the sample and restored (``_keyed.keyed_run``). Raises what ``run`` raises."""

    def call() -> dict:
        random.start(key, position)
        return run(fn, sample, random.generator)

    return keyed_run(call, key, position, PIPELINE)
