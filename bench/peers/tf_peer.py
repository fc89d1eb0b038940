"""The peers a user would pick instead of batchd: tf.data in-process and tf.data service.

Both do pipeline L3's work with TensorFlow's own ops, on the same photo files, in the same run
as batchd and the PyTorch DataLoader (Table 1, ``bench/tables/table_workers.py``):

    read_file -> decode_jpeg (reduced-size decoding where the image stays >= 256x256, as batchd's
    workers do: ``ratio`` 8, 4 or 2) -> resize 256x256 (bilinear) -> flip left-right -> random
    crop 200x200 -> random brightness (+-0.2 x 255) and contrast (0.8-1.2) -> flip up-down
    -> uint8 -> batch 64

(L3 = Resize(256, 256), HorizontalFlip(p=1), RandomCrop(200, 200), RandomBrightnessContrast(p=1),
VerticalFlip(p=1): the flips always apply, so here too.) Random draws are stateless, seeded per
sample from (seed, position), so the work does not depend on the thread that does it.

- ``tf_data``: the pipeline runs in the consuming process; ``map`` with ``workers`` parallel
  calls on a private thread pool of ``workers`` threads (one intra-op thread), ``prefetch`` of
  2 x workers batches (DataLoader's default prefetch_factor=2 per worker, batchd's prefetch).
- ``tf_service``: the same dataset sent to a tf.data service: one dispatcher and one worker
  server started in the peer process (``DispatchServer``/``WorkerServer``, port 0, stopped at
  the end), the consumer reading through ``distribute("parallel_epochs", compression=None)``
  over gRPC on localhost (batchd TCP is uncompressed too). TensorFlow binds these servers to
  every interface (its configs choose the port only), so where it can (root, util-linux's
  ``unshare`` and iproute2's ``ip``) the peer process runs in a network namespace of its own
  with only loopback up: nothing outside that process can reach them. Elsewhere they listen on
  every interface for the run, and the table says so.

Each batch is handed over as torch tensors (``torch.from_numpy``: no copy), what a PyTorch
training loop would read, and consumed like every other method's batches (``measure.consume``).

All TensorFlow runs in one subprocess per worker count (``TFPeer``), started once and reused,
so that TensorFlow's threads and memory never sit in the process that measures batchd and the
DataLoader. The subprocess times its own stream with ``measure.time_stream``, whose CPU count
(``measure.tree_cpu_seconds``) covers the peer process with its TF threads and both servers.

``tensorflow-cpu`` is in the ``bench`` extra (``pip install -e '.[bench]'``; ``make bench``
installs it); without it Table 1 shows a "skipped" row (``SKIPPED``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from bench import module_argv, module_env

from bench.measure import StreamTiming

METHODS = ("tf_data", "tf_service")
CROP_METHOD = "tf_data_crop"  # Table 20: RandomResizedCrop(224) + flip with decode_and_crop_jpeg (_crop_pipeline)
LABELS = {"tf_data": "tf.data (in-process)", "tf_service": "tf.data service (1 worker)",
          CROP_METHOD: "tf.data decode_and_crop_jpeg"}
CROP_SIZE, CROP_AREA, CROP_RATIO = 224, (0.08, 1.0), (3 / 4, 4 / 3)  # albumentations' RandomResizedCrop defaults
PIPELINE = "L3"  # the pipeline the peers implement
SKIPPED = "skipped: tensorflow not installed (pip install -e '.[bench]', as make bench does)"
RESIZE, CROP = 256, 200
BRIGHTNESS, CONTRAST = 0.2 * 255.0, (0.8, 1.2)  # albumentations RandomBrightnessContrast's defaults
_START_S = 300.0  # TensorFlow's import and a first service job can take a while on a busy machine


def available() -> bool:
    """Whether TensorFlow can be imported here (checked without importing it)."""
    return importlib.util.find_spec("tensorflow") is not None


def private_network_available() -> bool:
    """Whether a process can be started in a network namespace of its own with loopback up
    (root, ``unshare`` and ``ip`` on PATH; checked by doing it once)."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    try:
        probe = subprocess.run(["unshare", "--net", "--", "ip", "link", "set", "lo", "up"], capture_output=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


class TFPeer:
    """One peer subprocess for ``workers`` parallel calls; ``start()`` it, ``measure()``, ``stop()``.

    files: image paths (str) in dataset order; labels: int per file. Raises RuntimeError (with the
    tail of the subprocess's log) if it does not start within 300 s or a measurement fails.
    """

    def __init__(self, files: list[str], labels: list[int], workers: int, batch_size: int = 64):
        if len(files) != len(labels) or not files:
            raise ValueError(f"TFPeer: {len(files)} files and {len(labels)} labels (need as many, at least one)")
        if workers < 1 or batch_size < 1:
            raise ValueError(f"TFPeer: workers ({workers}) and batch_size ({batch_size}) must be >= 1")
        self.files, self.labels, self.workers, self.batch_size = files, labels, workers, batch_size
        self.proc: subprocess.Popen | None = None
        self.version = ""
        self.isolated = False  # set by start(): the peer runs in a network namespace of its own
        self._tmp = tempfile.TemporaryDirectory(prefix="batchd-tf-peer-")
        self._log = pathlib.Path(self._tmp.name) / "peer.log"

    def start(self) -> "TFPeer":
        plan = pathlib.Path(self._tmp.name) / "files.json"
        plan.write_text(json.dumps({"files": self.files, "labels": self.labels}))
        env = module_env({**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
        command = module_argv("bench.peers.tf_peer", "--files", str(plan),
                              "--workers", str(self.workers), "--batch-size", str(self.batch_size))
        self.isolated = private_network_available()
        if self.isolated:  # unshare and sh exec in place: self.proc.pid is the peer's own pid
            command = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', *command]
        with open(self._log, "w") as log:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.version = self._reply(_START_S).get("tensorflow", "?")
        return self

    def measure(self, method: str, seed: int, warmup: int, timed: int) -> StreamTiming:
        """Time ``timed`` batches of ``method`` after ``warmup`` untimed ones (a new epoch order from ``seed``)."""
        if method not in (*METHODS, CROP_METHOD):
            raise ValueError(f"TFPeer.measure: unknown method {method!r}; expected one of {(*METHODS, CROP_METHOD)}")
        self.proc.stdin.write(json.dumps({"method": method, "seed": seed, "warmup": warmup, "timed": timed}) + "\n")
        self.proc.stdin.flush()
        r = self._reply(_START_S)
        return StreamTiming(r["seconds"], r["images"], r["batches"], r["cpu"])

    def wait_idle(self, timeout: float = 15.0, quiet_s: float = 0.1) -> None:
        """Until the peer process uses under 5% of a core over ``quiet_s`` (prefetching has stopped)."""
        from bench.measure import tree_cpu_seconds

        t0 = time.perf_counter()
        while self.proc is not None and time.perf_counter() - t0 < timeout:
            c0 = tree_cpu_seconds(self.proc.pid)
            time.sleep(quiet_s)
            if tree_cpu_seconds(self.proc.pid) - c0 < 0.05 * quiet_s:
                return

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # end of commands: the peer stops its servers and exits
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._tmp.cleanup()

    def _reply(self, timeout: float) -> dict:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                self.proc.kill()
                raise RuntimeError(f"the tf.data peer gave no answer for {timeout:g} s:\n{self._tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the tf.data peer exited with code {self.proc.wait(10)}:\n{self._tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the tf.data peer failed: {reply['error']}\n{self._tail()}")
        return reply

    def _tail(self, chars: int = 3000) -> str:
        try:
            return self._log.read_text()[-chars:]
        except OSError:
            return ""


# ---- the peer process ------------------------------------------------------------------------------


def _pipeline(tf, paths, labels, order, seed: int, workers: int, batch_size: int):
    """The L3 work as a tf.data dataset of (image uint8 [B, 200, 200, 3], label int64 [B])."""

    def decode(raw):
        h, w = tf.unstack(tf.image.extract_jpeg_shape(raw)[:2])

        def fits(r):  # libjpeg rounds a reduced size up, as batchd's reduced decoding assumes
            return tf.logical_and((h + r - 1) // r >= RESIZE, (w + r - 1) // r >= RESIZE)

        branch = tf.where(fits(8), 3, tf.where(fits(4), 2, tf.where(fits(2), 1, 0)))
        return tf.switch_case(branch, [lambda r=r: tf.io.decode_jpeg(raw, channels=3, ratio=r) for r in (1, 2, 4, 8)])

    def load(path, label, position):
        key = tf.stack([tf.constant(seed, tf.int64), position])
        keys = tf.random.experimental.stateless_split(key, num=3)  # one stream per random op
        image = decode(tf.io.read_file(path))
        image = tf.image.resize(image, (RESIZE, RESIZE))  # bilinear, float32
        image = tf.image.flip_left_right(image)
        image = tf.image.stateless_random_crop(image, (CROP, CROP, 3), seed=keys[0])
        image = tf.image.stateless_random_brightness(image, BRIGHTNESS, seed=keys[1])
        image = tf.image.stateless_random_contrast(image, *CONTRAST, seed=keys[2])
        image = tf.image.flip_up_down(image)
        return tf.cast(tf.clip_by_value(image, 0.0, 255.0), tf.uint8), label

    return _batched(tf, load, paths, labels, order, workers, batch_size)


def _batched(tf, load, paths, labels, order, workers: int, batch_size: int):
    """``load(path, label, position)`` mapped over the files in ``order`` with ``workers``
    parallel calls on a private pool of as many threads (one intra-op thread, no autotuning),
    batched (``drop_remainder``), ``prefetch`` 2 x workers batches."""
    positions = tf.range(len(order), dtype=tf.int64)
    ds = tf.data.Dataset.from_tensor_slices((tf.gather(paths, order), tf.gather(labels, order), positions))
    ds = ds.map(load, num_parallel_calls=workers, deterministic=True)
    ds = ds.batch(batch_size, drop_remainder=True).prefetch(max(2, 2 * workers))
    options = tf.data.Options()
    options.threading.private_threadpool_size = workers
    options.threading.max_intra_op_parallelism = 1
    options.autotune.enabled = False  # exactly `workers` threads, as the other methods get
    return ds.with_options(options)


def _crop_pipeline(tf, paths, labels, order, seed: int, workers: int, batch_size: int):
    """RandomResizedCrop(224) + HorizontalFlip(p=0.5) as tf.data users write it (TensorFlow's
    ImageNet ``preprocess_for_train``): a crop drawn with ``stateless_sample_distorted_bounding_box``
    (8-100% of the area, aspect 3:4-4:3, 10 attempts, else the whole image) from the JPEG's
    header shape, ``decode_and_crop_jpeg`` (libjpeg decodes only the crop's rows and columns), a
    bilinear resize to 224 x 224, a left-right flip with p = 0.5, uint8. Threads and prefetch as
    ``_pipeline`` (``_batched``). Yields (image uint8 [B, 224, 224, 3], label int64 [B])."""
    whole = tf.constant([[[0.0, 0.0, 1.0, 1.0]]])

    def load(path, label, position):
        key = tf.stack([tf.constant(seed, tf.int64), position])
        keys = tf.random.experimental.stateless_split(key, num=2)
        raw = tf.io.read_file(path)
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.io.extract_jpeg_shape(raw), bounding_boxes=whole, seed=keys[0], min_object_covered=0.0,
            aspect_ratio_range=CROP_RATIO, area_range=CROP_AREA, max_attempts=10, use_image_if_no_bounding_boxes=True)
        y, x, _ = tf.unstack(begin)
        h, w, _ = tf.unstack(size)
        image = tf.image.decode_and_crop_jpeg(raw, tf.stack([y, x, h, w]), channels=3)
        image = tf.image.resize(image, (CROP_SIZE, CROP_SIZE))  # bilinear, float32
        image = tf.image.stateless_random_flip_left_right(image, seed=keys[1])
        return tf.cast(tf.clip_by_value(image, 0.0, 255.0), tf.uint8), label

    return _batched(tf, load, paths, labels, order, workers, batch_size)


class _Services:
    """A dispatcher and one worker, in this process, started at first use."""

    def __init__(self, tf):
        self.tf = tf
        self.dispatcher = self.worker = None

    def target(self) -> str:
        svc = self.tf.data.experimental.service
        if self.dispatcher is None:
            self.dispatcher = svc.DispatchServer(svc.DispatcherConfig(port=0))
            address = self.dispatcher.target.split("://", 1)[1]
            # heartbeats every 100 ms: a finished job's task stops at once, not after 30 s
            self.worker = svc.WorkerServer(svc.WorkerConfig(dispatcher_address=address, port=0,
                                                            worker_address="127.0.0.1:%port%",
                                                            heartbeat_interval_ms=100))
        return self.dispatcher.target

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        if self.dispatcher is not None:
            self.dispatcher._stop()  # DispatchServer has no public stop(); this is what its tests call


def _serve(args: argparse.Namespace) -> int:
    out = os.fdopen(os.dup(1), "w")  # replies on the original stdout; everything else goes to the log
    os.dup2(2, 1)
    import numpy as np
    import tensorflow as tf
    import torch

    from bench.measure import pin_threads, time_stream

    pin_threads()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    plan = json.loads(pathlib.Path(args.files).read_text())
    paths = tf.constant(plan["files"])
    labels = tf.constant(plan["labels"], tf.int64)
    services = _Services(tf)

    def reply(obj) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    def batches(ds):
        for image, label in ds:
            yield {"image": torch.from_numpy(image.numpy()), "label": torch.from_numpy(label.numpy())}

    reply({"ready": True, "tensorflow": tf.__version__})
    try:
        for line in sys.stdin:
            try:
                cmd = json.loads(line)
                # the order goes on past the timed batches (prefetch + a batch per thread, never
                # consumed), so the pipeline is as full when the window closes as when it opened,
                # as batchd's stream and bench.peers.torch_loader.time_loader are
                tail = max(2, 2 * args.workers) + args.workers
                need = (cmd["warmup"] + cmd["timed"] + tail) * args.batch_size
                rng = np.random.default_rng(cmd["seed"])  # a fresh shuffled order, as bench.peers.torch_loader.Plan
                n = len(plan["files"])
                order = np.concatenate([rng.permutation(n) for _ in range(-(-need // n))])[:need]
                build = _crop_pipeline if cmd["method"] == CROP_METHOD else _pipeline
                ds = build(tf, paths, labels, order, cmd["seed"], args.workers, args.batch_size)
                if cmd["method"] == "tf_service":
                    ds = ds.apply(tf.data.experimental.service.distribute(
                        "parallel_epochs", services.target(), compression=None))
                t = time_stream(batches(ds), cmd["warmup"], cmd["timed"])
                reply({"seconds": t.seconds, "images": t.images, "batches": t.batches, "cpu": t.cpu})
            except Exception as e:  # the parent raises it with this process's log
                reply({"error": f"{type(e).__name__}: {e}"})
    finally:
        services.stop()
    return 0


def render(r: dict) -> str:
    """Table 1's peer rows (markdown), or the skipped row: images/s, speedup, vs batchd, CPU per image."""
    from bench.report import fx, md_table

    head = ["workers", "pipeline", "method", "img/s (speedup over sequential)", "batchd shm / this",
            "batchd TCP / this", "CPU ms/image", "this / batchd shm CPU"]
    if r.get("peers") != "measured":
        why = r.get("peers") or "not measured (results from before the peers were added)"
        return "\n**Peers: tf.data**\n\n" + md_table(head, [["-", PIPELINE, "tf.data, tf.data service", why,
                                                               "", "", "", ""]])
    rows = []
    for row in r["rows"]:
        m, c = row["median"], row.get("cpu_per_image", {})
        for k in METHODS:
            if k not in m:
                continue
            rows.append([row["workers"], row["pipeline"], LABELS[k], f"{m[k]:.0f} ({fx(m[k] / m['sequential'])})",
                         fx(m["batchd_shm"] / m[k]), fx(m["batchd_tcp"] / m[k]),
                         f"{c[k] * 1e3:.2f}" if k in c else "", fx(c[k] / c["batchd_shm"]) if k in c else ""])
    return ("\n**Peers: tf.data** (tensorflow-cpu " + r.get("tf_version", "?") + "; the same run, interleaved with the "
            "methods above; L3's work with TF ops, see bench/peers/tf_peer.py; CPU summed over the peer process, its TF "
            "threads and the tf.data service's dispatcher and worker; "
            + ("the peer ran in a network namespace of its own with only loopback, since TensorFlow binds the "
               "service's servers to every interface" if r.get("tf_isolated") else
               "TensorFlow bound the service's servers to every interface of this host for the run")
            + ")\n\n" + md_table(head, rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The tf.data peer process (started by TFPeer; reads commands on stdin).")
    p.add_argument("--files", required=True, help="JSON file: {files: [...], labels: [...]}")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=64)
    return _serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
