"""A stream request checked before anything starts: the loader's validation of ``StreamRequest``.

``RequestChecks`` is mixed into ``Loader`` (``loader.py``), whose ``open_stream`` calls
``_validated`` first: the request checked against the dataset(s) and the server's config
(batch size, rank, prefetch, transport, batch range), its pipeline resolved (a preset by name,
or a client's albumentations JSON checked against the allowlist and built once per key), a
sampler's or a mix's order checked (``serve/orders.py``), and its defaults filled in. Each bad
field is a ValueError naming it and its value (answered INVALID_ARGUMENT), before any batch is
built. It needs the loader's ``config``, ``dataset``, ``weights``, ``dataset_weights``,
``_presets`` (preset name -> canonical JSON) and ``_checked`` (pipeline keys already built).
"""

from __future__ import annotations

import dataclasses

from batchd.sampler import num_batches
from batchd.server.compute import allowlist
from batchd.server.compute import encoded
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute.protocol import StreamRequest
from batchd.server.serve import orders
from batchd.server.serve.weights import Weights


class RequestChecks:
    """The loader's checks of a stream request and its pipeline (see the module docstring)."""

    def _pipeline(self, preset: str, albumentations_json: str) -> tuple[str, str]:
        """(name for logs, canonical JSON) of a request's pipeline. Raises ValueError."""
        if preset and albumentations_json:
            raise ValueError("give either a preset name or an albumentations pipeline, not both")
        if preset:
            if preset not in self._presets:
                raise ValueError(f"unknown pipeline preset {preset!r}; this server has {sorted(self._presets)}")
            return preset, self._presets[preset]
        if not albumentations_json:
            return "none", ""
        # a client's pipeline is checked against the allowlist before albumentations sees it
        text = pipelines.canonical_json(allowlist.check_text(albumentations_json, self.config.pipeline_limits))
        key = pipelines.pipeline_key(text)
        if key not in self._checked:
            pipelines.build(text)
            if len(self._checked) >= 4096:  # bounded: clients may send any number of distinct pipelines
                self._checked.clear()
            self._checked[key] = None
        return "custom:" + key[:8], text

    def _validated(self, args: StreamRequest) -> tuple[StreamRequest, int, Weights | None]:
        """``args`` checked against the dataset(s) and the config, with its defaults filled in, the
        epoch's batch count for its shard, and a weighted request's weights; raises as
        ``open_stream`` says (and WeightsNotFoundError: weights named by a digest not held here)."""
        cfg = self.config
        if args.sampler is not None and args.mix is not None:
            raise ValueError("give either a sampler or a mix, not both")
        weights, order_key, mix = None, "", args.mix
        if mix is not None:
            mix, order_key = orders.check_mix(args, self.dataset, self._resolved_pipeline)
            ds = self.dataset(mix.sources[0].dataset)
        else:
            ds = self.dataset(args.dataset)
        if not 1 <= args.batch_size <= cfg.max_batch_size:
            raise ValueError(f"batch_size must be in [1, {cfg.max_batch_size}], got {args.batch_size}")
        world_size = args.world_size or 1
        if not 0 <= args.rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {args.rank}")
        prefetch = args.prefetch or cfg.default_prefetch
        if prefetch > cfg.max_prefetch:
            raise ValueError(f"prefetch must be at most {cfg.max_prefetch}, got {prefetch}")
        if len(ds) == 0:
            raise ValueError(f"dataset {args.dataset!r} has no samples")
        if args.transport not in ("shm", "inline", "socket") or args.compression not in ("none", "lz4"):
            raise ValueError(f"transport must be 'shm', 'inline' or 'socket' and compression 'none' or 'lz4', "
                             f"got {args.transport!r}, {args.compression!r}")
        name, text = self._pipeline(args.preset, args.albumentations_json) if mix is None else ("mix", "")
        encoded.check_request(ds, args.image_encoding, text)  # JPEG: files the client can decode, its resize
        if args.sampler is not None:
            weights, order_key = orders.check_sampler(args, ds, self.weights, self.dataset_weights)
        length = orders.epoch_length(args, len(ds))
        if args.start_position >= length:
            raise ValueError(f"start_position {args.start_position} is past the epoch's samples (dataset "
                             f"{args.dataset!r}: {length} per epoch)")
        n = num_batches(length, args.batch_size, world_size=world_size, drop_last=args.drop_last,
                        start_position=args.start_position)
        if args.start_batch > n:
            raise ValueError(f"start_batch {args.start_batch} is past the end of the epoch ({n} batches)")
        if args.end_batch and not args.start_batch < args.end_batch <= n:
            raise ValueError(f"end_batch must be in (start_batch={args.start_batch}, {n}] (the epoch's batches) "
                             f"or 0, got {args.end_batch}")
        stride = args.batch_stride or 1
        if not 0 <= args.batch_offset < stride:
            raise ValueError(f"batch_offset must be in [0, batch_stride={stride}), got {args.batch_offset}")
        request = dataclasses.replace(
            args, world_size=world_size, prefetch=prefetch, batch_stride=stride,
            pipeline_name=name, pipeline_key=pipelines.pipeline_key(text), pipeline_json=text,
            mix=mix, order_key=order_key,
        )
        return request, n, weights

    def _resolved_pipeline(self, preset: str, albumentations_json: str) -> tuple[str, str, str]:
        """(name, canonical JSON, key) of a pipeline (a mix source's). Raises ValueError."""
        name, text = self._pipeline(preset, albumentations_json)
        return name, text, pipelines.pipeline_key(text)
