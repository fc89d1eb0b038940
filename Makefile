# batchd: the single entry point for developers and CI.
#
#   make install   create .venv, install torch, then batchd (editable, its C region decoder built) with its
#                  client and test extras; installs the libjpeg62-turbo-dev, libturbojpeg0, Fashion-MNIST,
#                  mate-backgrounds (photos) and prometheus (promtool) Debian packages when missing (root + apt)
#   make test      run the test suite            (PYTEST_ARGS='-k deploy -x' to pass options)
#   make test-containers  build the images and run the three Compose stacks in a real Docker engine
#                  (root: installs docker.io, docker-compose and debootstrap, starts dockerd if none runs)
#   make demo      train a small CNN on Fashion-MNIST through a local batchd server (ARGS=...)
#   make bench     run the benchmarks (ARGS=...); installs the bench extra (tensorflow-cpu) and photos
#   make docs      build the docs site into site/ (mkdocs, --strict: broken links fail)
#   make proto     regenerate batchd.v1's *_pb2 code from proto/batchd/v1/*.proto
#   make clean     remove .venv and everything generated
#
# torch. The default wheel of `torch` on PyPI is a multi-GB CUDA build. Without a GPU (no
# `nvidia-smi` on PATH) install asks for TORCH_SPEC=torch==2.13.0, which on this project's
# machines resolves to a CPU wheel shipped with them. CPU-only users elsewhere get the small
# CPU build from PyTorch's own index with
#     make install TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu'
# and anyone may choose another build, e.g. make install TORCH_SPEC='torch==2.13.0'.
# install is stamped (.venv/.installed, redone when pyproject.toml changes): after changing
# TORCH_SPEC or TORCH_PIP_ARGS on an existing .venv, run `make clean install`.
#
# Works non-interactively (CI=true, no terminal): pip and apt never prompt.
#
# test-containers (tests/containers/): no image registry is needed. The Dockerfiles' PYTHON_IMAGE
# is built from Debian packages with debootstrap (cached in .cache/containers), the trainer image
# gets torch's CPU wheel from the folder pip's configuration names as find-links, pip fetches the
# rest from PyPI. dockerd is started when none answers and stopped afterwards; every container,
# network, volume and image the run made is removed; logs in $(CONTAINER_LOGS). From a clean
# clone on a 2-core machine under load: 37 minutes (install 4, debootstrap and builds 11, each of
# the three stacks 6-9: two epochs of training). .ci/run runs it after `make test`.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
.DELETE_ON_ERROR:

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
TORCH_SPEC ?= torch==2.13.0
else
TORCH_SPEC ?= torch
endif
TORCH_PIP_ARGS ?=

ARGS ?=
PYTEST_ARGS ?=

FMNIST_FILE := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
# libjpeg-turbo's TurboJPEG library (server/data/scaled_jpeg.py), wherever ldconfig finds it
TURBOJPEG_LIB := $(or $(shell /sbin/ldconfig -p 2>/dev/null | grep -o '/[^ ]*/libturbojpeg\.so\.0$$' | head -1),/usr/lib/libturbojpeg.so.0)
MATE_PHOTOS := /usr/share/backgrounds/mate/nature
CONTAINER_LOGS ?= .cache/containers/logs
CONTAINER_TIMEOUT_S ?= 3600

export PIP_NO_INPUT := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export DEBIAN_FRONTEND := noninteractive
ifneq ($(filter true TRUE True 1 yes,$(CI)),)
export PIP_PROGRESS_BAR := off
endif

# $(call apt_provide,PACKAGE,PATH-IT-PROVIDES,WHO-NEEDS-IT): install a Debian package when the
# path is missing and we can (root with apt-get); otherwise say how. Never fatal: the tests
# that need the data skip with a reason, and the scripts that need it say what is missing.
define apt_provide
	@if [ -e '$(2)' ]; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo ">> $(2) is missing: apt-get install $(1)"; \
	  { apt-get update -q && apt-get install -y -q --no-install-recommends $(1); } \
	    || echo "!! apt-get install $(1) failed; $(3) will not work until it is installed" >&2; \
	else \
	  echo "!! $(2) is missing (wanted by $(3))." >&2; \
	  echo "   On Debian/Ubuntu: sudo apt-get install $(1)" >&2; \
	  echo "   Elsewhere: get the files that package ships and put them at that path." >&2; \
	fi
endef

.PHONY: help install datasets demo test test-containers container-deps docs proto bench bench-deps clean

help:
	@sed -n '3,13p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

install: $(STAMP) datasets

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, so that the dependency `torch>=2.1` of batchd[client] is already met by the right build.
$(STAMP): pyproject.toml | $(PY)
	$(call apt_provide,libjpeg62-turbo-dev,/usr/include/jpeglib.h,the region JPEG decoder (server/data/_jpeg_region.c; whole images are decoded without it))
	$(PY) -m pip install $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(PY) -m pip install -e '.[client,test]'
	@touch $@

datasets:
	$(call apt_provide,libturbojpeg0,$(TURBOJPEG_LIB),scaled JPEG decoding (server/data/scaled_jpeg.py; OpenCV decodes without it))
	$(call apt_provide,dataset-fashion-mnist,$(FMNIST_FILE),the Fashion-MNIST demo and tests)
	$(call apt_provide,mate-backgrounds,$(MATE_PHOTOS),tests/compute/test_region.py and the photo benchmarks)
	$(call apt_provide,prometheus,/usr/bin/promtool,tests/serve/test_metrics_names.py (promtool check metrics))

demo: install
	$(PY) examples/train_fashion_mnist.py $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Debian's Docker engine (20.10) and Compose (1.29), and debootstrap for the base image: installed
# together when one is missing (root + apt); without them the tests fail naming what is missing.
container-deps:
	@if command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo ">> apt-get install docker.io docker-compose debootstrap"; \
	  apt-get update -q && apt-get install -y -q --no-install-recommends docker.io docker-compose debootstrap; \
	else \
	  echo "!! make test-containers needs docker.io, docker-compose and debootstrap (and root to start dockerd)" >&2; \
	fi

test-containers: install container-deps
	mkdir -p $(CONTAINER_LOGS)
	BATCHD_CONTAINER_TESTS=1 BATCHD_CONTAINER_LOGS=$(CONTAINER_LOGS) timeout --signal=INT --kill-after=120 $(CONTAINER_TIMEOUT_S) \
	  $(PY) -m pytest -q -p no:cacheprovider tests/containers $(PYTEST_ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

proto: $(STAMP)
	$(PY) proto/generate.py

bench-deps:
	$(call apt_provide,mate-backgrounds,$(MATE_PHOTOS),the photo benchmark (bench/fixtures/make_photos.py))

bench: install bench-deps
	$(PY) -c 'import matplotlib, psutil, tensorflow' 2>/dev/null || $(PY) -m pip install -e '.[client,bench]' \
	  || { echo '!! the bench extra did not install: Table 1 skips the tf.data peers' >&2; \
	       $(PY) -m pip install 'matplotlib>=3.7' 'psutil>=5.9'; }
	$(PY) -m bench.run_all $(ARGS)

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .hypothesis .cache bench/data
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
