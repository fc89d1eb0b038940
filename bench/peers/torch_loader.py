"""The PyTorch DataLoader baseline: the same decode and transform code in DataLoader workers.

One ``DataLoader`` per worker count, ``persistent_workers=True``, reused across pipelines,
batch sizes and repeats: every item is ``(pipeline_name, sample_index)``, and ``Plan`` (the
batch sampler) is told before each ``iter()`` which batches to yield. Workers pin OpenCV to one
thread as batchd's do, and start from ``forkserver`` (this process also runs gRPC clients,
which must not be forked).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class PhotoDataset(Dataset):
    """``dataset[(pipeline, index)] -> (image uint8 [H, W, 3], label)`` with batchd's decode code
    (including its reduced JPEG decoding, as a batchd worker asks for it)."""

    def __init__(self, name: str, cfg, cache_dir, presets: dict[str, dict]):
        self.name, self.cfg, self.cache_dir, self.presets = name, cfg, cache_dir, presets
        self._ds = None
        self._pipes: dict = {}
        self._len = len(self._open(build=True))  # builds the index here; workers only map it
        self._ds = None

    def _open(self, build: bool = False):
        if self._ds is None:
            from batchd.server.data.datasets import open_dataset

            self._ds = open_dataset(self.name, self.cfg, self.cache_dir, build=build)
        return self._ds

    def __getstate__(self):
        return {**self.__dict__, "_ds": None, "_pipes": {}}

    def __len__(self) -> int:
        return self._len

    def pipeline(self, pipe: str):
        """(compose, decode min size) of preset ``pipe``, built once per worker; (None, None) for ""."""
        if not pipe:
            return None, None
        entry = self._pipes.get(pipe)
        if entry is None:
            import albumentations as A

            from bench.common import decode_min_size

            compose = A.from_dict(self.presets[pipe])
            entry = self._pipes[pipe] = (compose, decode_min_size(compose))
        return entry

    def __getitem__(self, item):
        from bench.common import load_image

        pipe, index = item
        ds = self._open()
        compose, min_size = self.pipeline(pipe)
        image = load_image(ds, index, min_size)
        if compose is not None:
            image = compose(image=image)["image"]
        return image, ds.label(index)


class ImreadDataset(Dataset):
    """``dataset[(pipeline, index)] -> (image uint8 [H, W, 3], label)`` as a DataLoader user
    writes it: ``cv2.imread`` of the file, BGR -> RGB, the albumentations preset (built once per
    worker). paths: files; labels: int per file; presets: name -> ``A.to_dict``."""

    def __init__(self, paths: list[str], labels: list[int], presets: dict[str, dict]):
        self.paths, self.labels, self.presets = paths, labels, presets
        self._pipes: dict = {}

    def __getstate__(self):
        return {**self.__dict__, "_pipes": {}}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, item):
        import albumentations as A
        import cv2

        pipe, index = item
        compose = self._pipes.get(pipe)
        if compose is None:
            compose = self._pipes[pipe] = A.from_dict(self.presets[pipe])
        image = cv2.cvtColor(cv2.imread(self.paths[index], cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        return compose(image=image)["image"], self.labels[index]


class Plan:
    """A batch sampler whose batches are set before each epoch (``set``)."""

    def __init__(self):
        self.batches: list[list[tuple[str, int]]] = []

    def set(self, pipeline: str, num_samples: int, batch_size: int, num_batches: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        need = batch_size * num_batches
        order = np.concatenate([rng.permutation(num_samples) for _ in range(-(-need // num_samples))])[:need]
        self.batches = [[(pipeline, int(i)) for i in order[b * batch_size:(b + 1) * batch_size]]
                        for b in range(num_batches)]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _init_worker(_worker_id: int) -> None:
    import cv2

    cv2.setNumThreads(1)  # torch already sets its own threads to 1 in DataLoader workers


def make_loader(dataset: Dataset, workers: int, prefetch_factor: int = 2) -> tuple[DataLoader, Plan]:
    # 4 workers on 2 cores is what Table 1 measures on purpose: no "suggested max" warning
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    plan = Plan()
    loader = DataLoader(
        dataset, batch_sampler=plan, num_workers=workers, persistent_workers=True,
        prefetch_factor=prefetch_factor, worker_init_fn=_init_worker, multiprocessing_context="forkserver",
    )
    return loader, plan


def time_loader(loader: DataLoader, plan: Plan, pipeline: str, num_samples: int, batch_size: int,
                warmup: int, timed: int, seed: int, **time_kw):
    """``bench.measure.time_stream`` over ``loader``, with its workers as busy at the end of the timed
    window as at its start.

    The plan holds ``workers x prefetch_factor`` batches more than ``warmup + timed`` (consumed
    untimed afterwards, so the persistent workers are idle before the next measurement). Without
    them the window would open with every worker's batches already under way and close with none:
    up to a round of the workers' work done before the clock started, counted as if done inside
    it (16 workers, 16 timed batches: up to half of them), while batchd's stream goes on past the
    window as it goes on before it. ``time_kw``: ``on_start``/``on_end`` as ``time_stream`` takes.
    """
    from bench.measure import time_stream

    tail = loader.num_workers * (loader.prefetch_factor or 2)
    plan.set(pipeline, num_samples, batch_size, warmup + timed + tail, seed)
    it = iter(loader)
    try:
        return time_stream(it, warmup, timed, **time_kw)
    finally:
        for batch in it:  # the tail, untimed
            del batch


def worker_pids(loader: DataLoader) -> list[int]:
    it = getattr(loader, "_iterator", None)
    return [w.pid for w in getattr(it, "_workers", [])]


def as_dict(batch) -> dict[str, torch.Tensor]:
    image, label = batch
    return {"image": image, "label": label}
