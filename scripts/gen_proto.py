"""Regenerate ``kvcoord/proto/VERSION/*`` from ``proto/kvcoord/VERSION/*.proto`` (every version there).

The sources are staged as ``kvcoord/proto/VERSION/`` so the generated modules import each other as
``kvcoord.proto.VERSION``. Usage: ``python scripts/gen_proto.py [OUT_DIR]`` (default: the package).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = REPO / "proto" / "kvcoord"


def versions() -> list[str]:
    return sorted(p.name for p in SOURCES.iterdir() if p.is_dir() and any(p.glob("*.proto")))


def generate(out_root: Path) -> list[Path]:
    """Generate into ``out_root/kvcoord/proto/VERSION`` and return the generated files."""
    out: list[Path] = []
    for version in versions():
        out += _generate(out_root, version)
    return out


def _generate(out_root: Path, version: str) -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "kvcoord" / "proto" / version
        staged.mkdir(parents=True)
        protos = sorted((SOURCES / version).glob("*.proto"))
        for src in protos:
            shutil.copy(src, staged / src.name)
        bindir = str(Path(sys.executable).parent)
        env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
        out_root.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp}", f"--python_out={out_root}",
             f"--grpc_python_out={out_root}", f"--mypy_out={out_root}", f"--mypy_grpc_out={out_root}",
             *[str(staged / p.name) for p in protos]],
            check=True,
            env=env,
        )
    out = out_root / "kvcoord" / "proto" / version
    banner = f'"""Generated from proto/kvcoord/{version} by scripts/gen_proto.py; do not edit."""\n'
    (out / "__init__.py").write_text(banner)
    return sorted(p for p in out.iterdir() if p.is_file())


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO
    for path in generate(root):
        print(path.relative_to(root))
