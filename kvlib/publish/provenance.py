"""Result files with provenance: git commit, device, package versions, parameters, time.

Every number in the book comes from a file written here. Files are written atomically
(temporary file + ``os.replace``) and a result of a larger profile is never replaced by a
smaller one without ``overwrite=True``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

#: profiles in increasing scale; a result is never silently replaced by a smaller profile
PROFILES = ("ci", "cpu", "gpu")
PACKAGES = ("torch", "triton", "numpy", "scipy", "transformers", "statsmodels", "pandas", "kvlib")


def repo_root() -> Path:
    """The project root (the folder holding ``kvlib/``)."""
    return Path(__file__).resolve().parents[2]


def results_dir(profile: str) -> Path:
    """``data/results/<profile>`` (``$KVLIB_RESULTS_DIR`` replaces ``data/results``, for tests)."""
    env = os.environ.get("KVLIB_RESULTS_DIR")
    base = Path(env) if env else repo_root() / "data" / "results"
    return base / profile


def git_commit() -> str:
    """Current commit, with ``+dirty`` when the tree has uncommitted changes; ``unknown`` outside git.

    ``$KVLIB_COMMIT`` names it where the tree travelled without ``.git`` (the GPU machine).
    """
    if os.environ.get("KVLIB_COMMIT"):
        return os.environ["KVLIB_COMMIT"]
    try:
        root = repo_root()
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "kvlib", "notebooks"],
            cwd=root, capture_output=True, text=True, timeout=10,
        )
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {"host_cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
        else:
            info["device"] = "cpu"
    except ImportError:
        info["device"] = "cpu"
    return info


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    out["python"] = platform.python_version()
    return out


def provenance(params: dict[str, Any], started: _dt.datetime | None = None) -> dict[str, Any]:
    now = _dt.datetime.now(_dt.UTC)
    started = started or now
    return {
        "commit": git_commit(),
        "device": device_info(),
        "packages": package_versions(),
        "params": params,
        "started": started.isoformat(timespec="seconds"),
        "duration_s": round((now - started).total_seconds(), 3),
    }


def _jsonable(x: Any) -> Any:
    """Convert numpy/torch scalars and arrays to plain JSON; non-finite floats become strings."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return _jsonable(x.tolist())
    if np is not None and isinstance(x, np.generic):
        return _jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_jsonable(obj), f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_result(
    name: str,
    profile: str,
    payload: dict[str, Any],
    params: dict[str, Any],
    started: _dt.datetime | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``data/results/<profile>/<name>.json`` = provenance + payload, atomically.

    Refuses (ValueError) to replace an existing file whose recorded profile is larger than
    ``profile`` unless ``overwrite`` is true.
    """
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    path = results_dir(profile) / f"{name}.json"
    if path.exists() and not overwrite:
        try:
            old = json.loads(path.read_text()).get("profile", profile)
        except (json.JSONDecodeError, OSError):
            old = profile
        if old in PROFILES and PROFILES.index(old) > PROFILES.index(profile):
            raise ValueError(f"{path} holds a {old!r} result; refusing to overwrite it with a {profile!r} run")
    record = {"name": name, "profile": profile, "provenance": provenance(params, started), **payload}
    write_json_atomic(path, record)
    return path


def load_result(name: str, profile: str) -> dict[str, Any] | None:
    """The result ``name`` of ``profile``, or None when absent. ``dev/<probe>`` names a development probe's
    result, kept with the probes in the top-level ``dev/results/`` (recorded on the GPU; ``profile`` unused)."""
    if name.startswith("dev/"):
        path = repo_root() / "dev" / "results" / f"{name[4:]}.json"
    else:
        path = results_dir(profile) / f"{name}.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    note_source(path, doc.get("provenance") if isinstance(doc, dict) else None)
    return doc


#: result files this process rendered (path -> (device, commit)): a page's "measured on" line lists them
SOURCES: dict[str, tuple[str, str]] = {}


def note_source(path: Path | str, prov: dict[str, Any] | None) -> None:
    """Remember that ``path`` (a committed result with provenance ``prov``) was read for this page."""
    if not prov:
        return
    dev = prov.get("device")
    dev = dev.get("device", "cpu") if isinstance(dev, dict) else str(dev or "unknown")
    p = Path(path)
    try:
        p = p.resolve().relative_to(repo_root())
    except ValueError:
        pass
    SOURCES[str(p)] = (dev, str(prov.get("commit", "unknown")))
