"""How a worker runs one pipeline: a ``Plan``, made once per pipeline and kept by the worker.

An albumentations pipeline is built from its canonical JSON (``pipeline.py``), split into the
deterministic prefix whose output the decoded-sample cache may hold and the random rest
(``prefix.py``), and run as one ``targets.TargetPipeline`` in those two stages, its transforms
drawing in turn from the sample's stream (``SampleRandom``). A python pipeline (``python_pipeline.py``)
is the operator's function; the cache then holds the dataset's samples as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchd.server.compute import pipeline as pipelines
from batchd.server.compute import prefix as prefixes
from batchd.server.compute import python_pipeline, region, targets


@dataclass(slots=True)
class Plan:
    """How a worker runs one pipeline: an albumentations ``compose`` (decoded at ``min_size``) run
    as ``targets`` in two stages (its cacheable prefix, ``split``, then the rest), or an
    operator's python ``fn``. ``split`` None: the pipeline cannot be split, ``targets`` runs all
    of it on each sample and nothing is cached. ``first``: its first transform, drawn ahead of a
    region decode (``region.py``; None: the pipeline does not start with one, or reduced
    decoding is off)."""

    compose: Any = None
    min_size: tuple[int, int] | None = None
    fn: Any = None
    split: prefixes.Split | None = None
    targets: targets.TargetPipeline | None = None
    cache_name: str = ""  # what the prefix's output depends on: its canonical text (+ target params)
    first: region.FirstStep | None = None


def make_plan(text: str, python_pipelines: dict[str, dict[str, Any]], *, reduced_decode: bool,
              random: pipelines.SampleRandom) -> Plan:
    """The plan of the pipeline ``text`` (canonical JSON, "" for none). python_pipelines: the
    server config's python presets (name -> {python, args}). reduced_decode: whether images may be
    decoded down to the pipeline's ``decode_min_size``. random: the worker's ``SampleRandom``,
    which the pipeline's transforms are attached to."""
    if python_pipeline.is_python(text):
        plan = Plan(fn=python_pipeline.build(text, python_pipelines))
        plan.split = prefixes.Split((), None, None, prefixes.canonical((), None))  # the cache holds the dataset's samples
        plan.cache_name = plan.split.canonical
        return plan
    compose = pipelines.build(text)
    plan = Plan(compose=compose, min_size=pipelines.decode_min_size(compose) if reduced_decode else None)
    try:
        plan.split = prefixes.split(compose, plan.min_size)
    except ValueError:  # the rest cannot be rebuilt: the whole pipeline runs on each sample, uncached
        plan.split = None
    if compose is not None:
        # one Compose, run in two stages: preprocess + prefix (cached), then the rest
        # (targets.py); its transforms draw in turn from one stream, re-keyed per sample
        prefix = len(plan.split.prefix) if plan.split is not None else 0
        plan.targets = targets.TargetPipeline.of(compose, attach=random.attach, prefix=prefix)
        random.attach(compose)
        plan.first = region.FirstStep.of(compose) if reduced_decode else None
    if plan.split is not None:
        plan.cache_name = plan.split.canonical + (plan.targets.params_name() if plan.targets else "")
    return plan
