"""Shared set-up of the tables: the photo dataset config, opened datasets, loaders over a server."""

from __future__ import annotations

import inspect
import itertools

import batchd
from batchd.server.config import ImageFolderConfig, ManifestConfig
from batchd.server.data.datasets import open_dataset

from bench.fixtures import data


def photos_config() -> ImageFolderConfig:
    return ImageFolderConfig(kind="imagefolder", root=data.PHOTOS)


def imagefolder_config(root) -> ImageFolderConfig:
    return ImageFolderConfig(kind="imagefolder", root=root)


def photos_x4_config() -> ManifestConfig:
    return ManifestConfig(kind="manifest", path=data.ensure_repeated_manifest(4))


def server_datasets(**cfgs) -> dict:
    """name -> config as a YAML-ready dict."""
    return {name: cfg.model_dump(mode="json", exclude_defaults=True) | {"kind": cfg.kind} for name, cfg in cfgs.items()}


def open_local(name: str, cfg):
    """The dataset opened in this process (own index cache), for the sequential loop."""
    return open_dataset(name, cfg, data.LOCAL_CACHE, build=True)


_unique = itertools.count(1)


def decode_min_size(compose):
    """What batchd's workers pass to ``load_image`` for this pipeline (reduced JPEG decoding), or None."""
    from batchd.server.compute import pipeline as server_pipeline

    fn = getattr(server_pipeline, "decode_min_size", None)
    return fn(compose) if fn is not None else None


def load_image(ds, index: int, min_size):
    """``ds.load_image`` as batchd's worker calls it (with min_size where this version has it)."""
    if min_size is not None and "min_size" in inspect.signature(ds.load_image).parameters:
        return ds.load_image(index, min_size)
    return ds.load_image(index)


def remote(address: str, dataset: str, *, batch_size: int, pipeline: str, workers: int, transport: str,
           seed: int = 0, compression: str | None = None, **kw) -> "batchd.RemoteDataLoader":
    """A RemoteDataLoader as the tables use it: shuffled, drop_last, prefetch 2 x workers.

    prefetch = 2 x workers matches DataLoader's default prefetch_factor=2 per worker (and keeps
    every server worker busy: a stream never has more than ``prefetch`` batches in flight).

    Every loader gets a seed of its own (``seed`` is mixed with a counter): the server shares one
    computation between streams whose requests agree on everything that fixes the bytes, so a
    second stream with the same seed would read batches already built for the first one.
    ``kw``: other RemoteDataLoader arguments (e.g. ``collate_fn``).
    """
    seed = seed * 1_000_003 + next(_unique)
    return batchd.RemoteDataLoader(
        address, dataset, batch_size=batch_size, shuffle=True, seed=seed, drop_last=True, transform=pipeline,
        prefetch=max(2, 2 * workers), transport=transport, compression=compression, timeout=300, **kw,
    )


def table_or_client_main(table, argv=None, *, client_args) -> int:
    """``table_main(table)``, or with ``--client`` one client of the table (a subprocess the table
    starts): ``client_args(parser)`` adds the client's options, ``table.client_main(args)`` runs it."""
    import argparse
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--client" not in argv:
        return table_main(table, argv)
    p = argparse.ArgumentParser(description=f"one client of {table.TITLE}")
    p.add_argument("--client", action="store_true")
    client_args(p)
    return table.client_main(p.parse_args(argv))


def table_main(table, argv=None, *, photos: bool = False, load_note: bool = False,
               quick_help: str = "fewer batches and 1 repeat", per: str = "configuration") -> int:
    """The command line of one table's module ``table`` (its ``__doc__``, ``TITLE``, ``run``,
    ``render``, ``targets``): --quick, --repeats; threads pinned, photos made if ``photos``,
    other processes' load waited out; prints the table, the load the noise guard saw if
    ``load_note``, each target PASS/FAIL and the seconds taken. Returns the exit status (0)."""
    import argparse
    import time

    from bench import noise
    from bench.measure import pin_threads
    from bench.settings import Settings

    p = argparse.ArgumentParser(description=table.__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--repeats", type=int, help=f"repeats per {per} (default 3; --quick: 1)")
    args = p.parse_args(argv)
    settings = Settings(quick=args.quick, repeats=args.repeats or (1 if args.quick else 3))
    pin_threads()
    if photos:
        data.ensure_photos()
    noise.configure(budget_s=5.0 if args.quick else 60.0)  # wait out (briefly) other processes' load
    t0 = time.perf_counter()
    r = table.run(settings, log=lambda msg: print(msg, flush=True))
    print(f"\n## {table.TITLE}\n\n{table.render(r)}\n")
    if load_note:
        g = noise.GUARD.take()
        print(f"Other processes used a median {g['foreign_median']:.0%} (max {g['foreign_max']:.0%}) of the machine's "
              f"CPU during the {g['measurements']} measurements ({g['retried']} re-measured).")
    for t in table.targets(r):
        print(f"- {'PASS' if t['passed'] else 'FAIL'} {t['name']}: {t['detail']}")
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0
