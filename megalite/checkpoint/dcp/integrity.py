"""--verify-integrity: a SHA-256 manifest of a checkpoint directory's files, as Megatron-Core
writes and checks it (megatron/core/dist_checkpointing/validation.py: save_integrity_manifest,
verify_integrity_manifest): `integrity.json` = {"algorithm": "sha256", "files": {name: hex}}
over the regular files directly in the directory, itself excluded. The same file name and
layout, so Megatron can verify megalite's checkpoints and megalite Megatron's.
"""

import hashlib
import json
from pathlib import Path

from megalite.checkpoint.dcp.format import CheckpointError

MANIFEST = "integrity.json"
ALGORITHM = "sha256"
_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_integrity_manifest(directory) -> Path:
    """Hash every file directly in `directory` into its integrity.json; its path."""
    directory = Path(directory)
    files = {p.name: file_sha256(p) for p in sorted(directory.iterdir(), key=str)
             if p.is_file() and p.name != MANIFEST}
    path = directory / MANIFEST
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"algorithm": ALGORITHM, "files": files}, indent=2))
    tmp.replace(path)
    return path


def verify_integrity_manifest(directory) -> int:
    """Check every file integrity.json lists; the number checked. Raises CheckpointError in
    one line naming the manifest and the first file that is missing or differs."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"--verify-integrity: {path} not found (the checkpoint was saved without "
                              "--verify-integrity)")
    try:
        manifest = json.loads(path.read_text())
        algorithm, files = manifest.get("algorithm", ALGORITHM), manifest["files"]
    except (ValueError, KeyError, AttributeError, TypeError):
        raise CheckpointError(f"--verify-integrity: {path} is not an integrity manifest") from None
    if algorithm != ALGORITHM:
        raise CheckpointError(f"--verify-integrity: {path} uses {algorithm!r}, not {ALGORITHM!r}")
    bad = []
    for name, expected in files.items():
        target = directory / name
        if not target.is_file():
            bad.append(f"{target} is missing")
        elif file_sha256(target) != expected:
            bad.append(f"{target} does not match its SHA-256 in {MANIFEST}")
    if bad:
        more = f" (and {len(bad) - 1} more file(s))" if len(bad) > 1 else ""
        raise CheckpointError(f"--verify-integrity: {bad[0]}{more}")
    return len(files)
