"""The results header: what machine and software the numbers come from."""

from __future__ import annotations

import datetime
import os
import platform


def _model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "?")
    except ImportError:
        return "not installed"


def info() -> dict:
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": _model_name(),
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "opencv": _version("cv2"),
        "albumentations": _version("albumentations"),
        "numpy": _version("numpy"),
        "grpcio": _version("grpc"),
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def render(m: dict) -> str:
    return (
        f"- machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory']} RAM, Linux {m['kernel']}; "
        f"load average at start {m['loadavg']}\n"
        f"- software: Python {m['python']}, torch {m['torch']}, OpenCV {m['opencv']}, "
        f"albumentations {m['albumentations']}, numpy {m['numpy']}, grpcio {m['grpcio']}\n"
        f"- date: {m['date']}"
    )
