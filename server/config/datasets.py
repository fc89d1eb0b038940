"""The dataset kinds of the server's config (``datasets:`` in its YAML): one model per ``kind``.

Example::

    datasets:
      fmnist-train: {kind: fashion-mnist, root: /usr/share/datasets/fashion-mnist, split: train}
      photos:       {kind: imagefolder, root: /data/photos}
      pets:         {kind: manifest, path: /data/pets.csv}
      shards:       {kind: webdataset, shards: "/data/train-{000000..000099}.tar"}
      mine:         {kind: python, factory: "mypkg.data:MyDataset", args: {root: /data/x}}
      det:          {kind: coco, images: /data/coco/train2017, annotations: /data/coco/instances_train2017.json, masks: true}
      voc:          {kind: segmentation, images: /data/voc/JPEGImages, masks: /data/voc/SegmentationClass}

``DatasetConfig`` picks the model by ``kind``; server/data/datasets/ opens each.
"""

from __future__ import annotations

import pathlib
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, field_validator

from .base import StrictModel
from ..data.storage import StorageOptions, is_remote, is_url, local_path


class _DatasetBase(StrictModel):
    """What every dataset kind accepts.

    on_error: "raise" (default) fails the stream at a sample that cannot be read or decoded,
        naming dataset, index and file; "skip" leaves it out of its batch (the batch lists it
        in ``skipped``) and logs it.
    max_skipped_fraction: with "skip", the stream fails once more than this fraction of the
        epoch's samples (of this shard) were skipped.
    max_pixels: decoded images larger than this (width x height) are bad samples.
    """

    on_error: Literal["raise", "skip"] = "raise"
    max_skipped_fraction: float = Field(default=0.01, ge=0.0, le=1.0)
    max_pixels: int = Field(default=1 << 28, ge=1)


class FashionMnistConfig(_DatasetBase):
    """The four IDX ``.gz`` files of Fashion-MNIST (or MNIST) in ``root``."""

    kind: Literal["fashion-mnist"]
    root: pathlib.Path
    split: Literal["train", "test"] = "train"


class _ImageFilesBase(_DatasetBase):
    """What dataset kinds of encoded image files accept, besides _DatasetBase's fields.

    reduced_decode: decode a JPEG at a fraction m/8 of its size (in libjpeg-turbo, much faster)
        when the pipeline's first transform downsizes it anyway: a resize (Resize, LongestMaxSize,
        SmallestMaxSize) or a random crop then resize (RandomResizedCrop, RandomSizedCrop: the
        crop is drawn first, from the sample's own stream, and the JPEG decoded at the scale that
        crop needs; server/compute/region.py). Off: always full size, as OpenCV decodes it. The
        pixels differ slightly (PSNR of the first transform's output against a full decode: mean
        >= 32 dB, none under 20 dB, docs/pipelines.md), so it is part of the build fingerprint
        (DescribeDataset).
    """

    reduced_decode: bool = True
    storage_options: StorageOptions = Field(default_factory=StorageOptions)


def _location(v: Any) -> Any:
    """A URL (``s3://``, ``gs://``, ``http(s)://``) stays a string; ``file://`` and plain paths become Paths."""
    if isinstance(v, str) and is_url(v):
        return v if is_remote(v) else pathlib.Path(local_path(v))
    return pathlib.Path(v) if isinstance(v, str) else v


# a local path or a URL (storage_options apply to URLs; see data/storage/)
Location = Annotated[Union[pathlib.Path, str], BeforeValidator(_location)]


def _extensions(v: tuple[str, ...]) -> tuple[str, ...]:
    """File name endings as given, lower-cased; ValueError if there are none or one is not ``.suffix``."""
    if not v:
        raise ValueError("give at least one extension, e.g. ['.jpg', '.png']")
    for e in v:
        if len(e) < 2 or not e.startswith("."):
            raise ValueError(f"extension {e!r} must start with '.' and name a suffix, e.g. '.jpg'")
    return tuple(e.lower() for e in v)


class ImageFolderConfig(_ImageFilesBase):
    """One subfolder of ``root`` per class, listed exactly as ``torchvision.datasets.ImageFolder``.

    Classes are the sorted folder names; a class's images are those found by
    ``sorted(os.walk(class_folder, followlinks=True))`` then sorted file names, in that order.
    extensions: file name endings that are images, any case (default: torchvision's
        IMG_EXTENSIONS .jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp).
    allow_empty: keep a class folder without images as a class with no samples; false (the
        default, as in torchvision): such a folder is an error naming it.
    """

    kind: Literal["imagefolder"]
    root: Location
    extensions: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    allow_empty: bool = False

    @field_validator("extensions")
    @classmethod
    def _check_extensions(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _extensions(v)


class ManifestConfig(_ImageFilesBase):
    """A CSV or Parquet table with columns ``path`` and ``label``; paths relative to its folder.

    weight_column: a numeric column of per-sample weights, the dataset's own weights for weighted
        sampling (``batchd.WeightedRandomSampler("dataset", num_samples)``; docs/sampling.md):
        finite, non-negative, not all zero (the server refuses the table otherwise, naming the row).
    """

    kind: Literal["manifest"]
    path: Location
    root: Location | None = Field(default=None, description="where relative paths start; default: the table's folder")
    weight_column: str | None = Field(default=None, min_length=1)


class WebDatasetConfig(_ImageFilesBase):
    """Tar shards in WebDataset's layout (``000123.jpg`` + ``000123.cls`` or ``.json``).

    shards: a list of paths or URLs, or one brace pattern (``/data/train-{000000..000099}.tar``).
    extensions: member extensions that are the image (the sample's first such member).
    label_field: the label's field in a sample's ``.json`` (used when it has no ``.cls``).
    """

    kind: Literal["webdataset"]
    shards: Union[str, tuple[str, ...]]
    extensions: tuple[str, ...] = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "pgm", "tif", "tiff")
    label_field: str = Field(default="label", min_length=1)

    @field_validator("shards")
    @classmethod
    def _check_shards(cls, v):
        if not v or (not isinstance(v, str) and not all(v)):
            raise ValueError("give shard paths or URLs, or one brace pattern such as /data/train-{000000..000099}.tar")
        return v


class CocoConfig(_DatasetBase):
    """A COCO "instances" JSON (``images``, ``annotations``, ``categories``) and its image folder.

    images: where the JSON's ``file_name``s are (a folder or a URL prefix).
    annotations: the JSON file (a path or a URL).
    masks: also give each object's mask (``masks`` uint8 [N, H, W]), decoded with pycocotools
        (``pip install batchd[coco]``); segmentations are then checked when the index is built.
    skip_empty: leave out images that have no annotation (after zero-size boxes are dropped);
        false (the default, as torchvision's CocoDetection): they are samples with N = 0.
    apply_exif_orientation: turn a JPEG by its EXIF orientation, and its boxes and masks with it;
        false (the default): the stored pixels, the frame of the annotations, pycocotools and
        torchvision's CocoDetection (as ``torchvision.io.decode_image``'s option of that name).
    annotations_frame: "stored" (the default): the annotation file is in the stored pixels (COCO's
        own tools, pycocotools); "upright": it was made on the photo as a viewer shows it, EXIF
        orientation applied (what web annotation tools give for an EXIF-turned JPEG): the image
        is turned upright and the boxes, masks and the JSON's width and height are taken as they
        are (whatever ``apply_exif_orientation`` says: the image is served upright either way).
    reduced_decode: when the pipeline starts with a random crop (RandomResizedCrop, RandomSizedCrop;
        server/compute/region.py), decode only that crop's window of a JPEG, at the smallest scale
        it still needs (drawn on the frame served: upright when either option above turns it);
        boxes and masks move with the full image's crop, equal to a full decode's, and are checked
        on the full frame. Off, or a pipeline starting otherwise (a first resize too): always full
        size (boxes and masks are in the full image's pixels).
    """

    kind: Literal["coco"]
    images: Location
    annotations: Location
    masks: bool = False
    skip_empty: bool = False
    apply_exif_orientation: bool = False
    annotations_frame: Literal["stored", "upright"] = "stored"
    reduced_decode: bool = True
    storage_options: StorageOptions = Field(default_factory=StorageOptions)


class SegmentationConfig(_DatasetBase):
    """An image folder and a mask folder paired by file stem (Pascal VOC's ``JPEGImages`` and
    ``SegmentationClass``): ``images/<stem>.jpg`` goes with ``masks/<stem>.png``.

    Stems are paths relative to the folder without the extension (subfolders allowed). Every
    image needs a mask and every mask an image (an error naming the first unpaired file),
    unless ``split_file`` names the stems to use.
    split_file: a text file of stems, one a line (VOC's ``ImageSets/Segmentation/train.txt``):
        the samples, in its order; each stem needs an image and a mask, other files are ignored.
        Default: every stem of the folders, sorted.
    extensions: image file endings, any case (default: torchvision's IMG_EXTENSIONS).
    mask_extensions: mask file endings (default ``.png``; masks must be lossless).
    ignore_index: the mask value that marks pixels to ignore (VOC: 255 on object borders and
        "difficult" regions); reported with the dataset, never changed in the masks. None: none.
    classes: class names, mask value ``v`` is ``classes[v]`` (optional: masks are read as they
        are whatever it says).
    apply_exif_orientation: turn a JPEG by its EXIF orientation, and its mask with it; false (the
        default): the stored pixels, the frame of the PNG masks (which carry no EXIF).
    Images are always decoded at full size (the mask must match them pixel for pixel).
    """

    kind: Literal["segmentation"]
    images: Location
    masks: Location
    split_file: Location | None = None
    extensions: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    mask_extensions: tuple[str, ...] = (".png",)
    ignore_index: int | None = Field(default=255, ge=0, le=255)
    classes: tuple[str, ...] = ()
    apply_exif_orientation: bool = False
    storage_options: StorageOptions = Field(default_factory=StorageOptions)

    @field_validator("extensions", "mask_extensions")
    @classmethod
    def _check_extensions(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _extensions(v)


# "package.module:attribute" (the attribute may be dotted), as entry points name objects
FACTORY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


class PythonConfig(_DatasetBase):
    """The operator's own map-style dataset (server/data/datasets/python.py).

    factory: ``"package.module:attribute"``, imported from the server's environment (installed, on
        PYTHONPATH, or on the server's ``python_path``) and called as ``factory(**args)``; the
        result has ``__len__`` and ``__getitem__(i) -> dict`` of fields.
    args: keyword arguments for the factory (YAML values: str, numbers, lists, mappings).
    per_object_fields: the fields with one entry per object (dropped with their boxes, sent as
        lists); default: those of boxes, labels, masks, keypoints, iscrowd, area the samples have.
    deterministic: true (the default): the server refuses a dataset whose ``__getitem__`` draws
        randomness batchd cannot key to (seed, epoch, index) (a generator of its own made in
        ``__init__``...; server/data/datasets/python.py); false: it warns and serves it, and never
        caches its samples (its batches then differ run to run).
    max_pixels does not apply (the dataset decodes its own images).
    """

    kind: Literal["python"]
    factory: str = Field(pattern=FACTORY_PATTERN)
    args: dict[str, Any] = Field(default_factory=dict)
    per_object_fields: tuple[str, ...] | None = None
    deterministic: bool = True


DatasetConfig = Annotated[
    Union[FashionMnistConfig, ImageFolderConfig, ManifestConfig, WebDatasetConfig, CocoConfig, SegmentationConfig,
          PythonConfig],
    Field(discriminator="kind"),
]
