"""load_config: YAML in, validated ServerConfig out; every error names the file and the field."""

from __future__ import annotations

import json
import pathlib
import re
import textwrap

import albumentations as A
import numpy as np
import pytest

from batchd.server.compute import pipeline as pipelines
from batchd.server.config import ConfigError, ServerConfig, load_config

pytestmark = pytest.mark.timeout(60)

GOOD = """\
address: 127.0.0.1:50051
workers: 3
datasets:
  fmnist-test: {kind: fashion-mnist, root: /usr/share/datasets/fashion-mnist, split: test}
  photos: {kind: imagefolder, root: /data/photos}
  pets: {kind: manifest, path: /data/pets.csv}
"""


def write(tmp_path: pathlib.Path, text: str, name: str = "batchd.yaml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config_error(path: pathlib.Path, **overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, **overrides)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert str(path) in msg, f"the error does not name the file: {msg}"
    return msg


def test_good_config(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert isinstance(cfg, ServerConfig)
    assert cfg.address == "127.0.0.1:50051" and cfg.workers == 3
    assert sorted(cfg.datasets) == ["fmnist-test", "pets", "photos"]
    assert cfg.datasets["fmnist-test"].kind == "fashion-mnist"
    assert cfg.datasets["fmnist-test"].split == "test"
    assert cfg.datasets["photos"].root == pathlib.Path("/data/photos")
    assert cfg.datasets["pets"].path == pathlib.Path("/data/pets.csv")


def test_unknown_field_typo(tmp_path):
    msg = config_error(write(tmp_path, GOOD + "worker: 2\n"))
    assert re.search(r"^\s*worker\b", msg, re.M), msg  # the line names the misspelt field itself


def test_unknown_nested_field_typo(tmp_path):
    text = GOOD.replace("split: test}", "split: test, rooot: /x}")
    msg = config_error(write(tmp_path, text))
    assert "fmnist-test" in msg and "rooot" in msg, msg


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1:http", "127.0.0.1:70000", ":50051", "unix:"])
def test_bad_address(tmp_path, address):
    msg = config_error(write(tmp_path, GOOD.replace("127.0.0.1:50051", json.dumps(address))))
    assert "address" in msg, msg


def test_zero_workers(tmp_path):
    msg = config_error(write(tmp_path, GOOD.replace("workers: 3", "workers: 0")))
    assert "workers" in msg, msg


def test_unknown_dataset_kind(tmp_path):
    msg = config_error(write(tmp_path, GOOD + "  recs: {kind: tfrecord, root: /data/recs}\n"))
    assert "recs" in msg and "tfrecord" in msg, msg


def test_missing_pipeline_file(tmp_path):
    missing = tmp_path / "nope" / "aug.json"
    msg = config_error(write(tmp_path, GOOD + f"pipelines:\n  train: {missing}\n"))
    assert "train" in msg and str(missing) in msg, msg


def test_not_yaml_and_missing_file(tmp_path):
    msg = config_error(write(tmp_path, "address: [unclosed\n"))
    assert "YAML" in msg
    config_error(tmp_path / "does-not-exist.yaml")
    msg = config_error(write(tmp_path, "- a list\n"))
    assert "mapping" in msg


def test_overrides_win(tmp_path):
    path = write(tmp_path, GOOD)
    cfg = load_config(path, address="127.0.0.1:0", workers=1)
    assert cfg.address == "127.0.0.1:0" and cfg.workers == 1
    cfg = load_config(path, address=None, workers=None)  # None means "not given"
    assert cfg.address == "127.0.0.1:50051" and cfg.workers == 3
    # an override is validated like the file
    msg = config_error(path, workers=0)
    assert "workers" in msg


def test_pipeline_file_written_by_albumentations(tmp_path):
    compose = A.Compose([
        A.HorizontalFlip(p=0.5),
        A.Affine(rotate=(-15, 15), p=0.8),
        A.RandomBrightnessContrast(p=0.5),
    ])
    aug = tmp_path / "aug.json"
    A.save(compose, str(aug), data_format="json")
    cfg = load_config(write(tmp_path, GOOD + f"pipelines:\n  train: {aug}\n  plain: null\n"))
    assert cfg.pipeline_json("plain") == ""
    text = cfg.pipeline_json("train")
    assert json.loads(text) == json.loads(json.dumps(A.to_dict(compose)))
    loaded = pipelines.build(text)
    assert isinstance(loaded, A.Compose)
    # the loaded pipeline augments exactly as the one that was saved
    image = np.random.default_rng(0).integers(0, 256, (28, 28, 1), dtype=np.uint8)
    for seed in range(5):
        compose.set_random_seed(seed)
        loaded.set_random_seed(seed)
        np.testing.assert_array_equal(compose(image=image)["image"], loaded(image=image)["image"])


def test_pipeline_file_that_is_not_a_pipeline(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2, 3]")
    msg = config_error(write(tmp_path, GOOD + f"pipelines:\n  train: {bad}\n"))
    assert "train" in msg, msg
