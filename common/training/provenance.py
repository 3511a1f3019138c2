"""What a checkpoint's ``provenance.json`` records about the run that made it: the command, the
code version, the libraries and the hardware."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

PROVENANCE_FILE = "provenance.json"
_LIBRARIES = ("torch", "transformers", "tokenizers", "fla-core", "flashinfer-python", "triton")


def code_version() -> str | None:
    """The git commit of this tree (with ``-dirty`` when files differ from it), if it is one."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10,
                               check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def environment(device: str) -> dict:
    import torch

    versions = {}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    hardware = {"cpu_count": os.cpu_count(), "machine": platform.machine()}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        hardware["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "code_version": code_version(),
        "python": platform.python_version(),
        "libraries": versions,
        "device": str(device),
        "hardware": hardware,
    }


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return path
