"""The committed generated modules are exactly what scripts/gen_proto.py makes from proto/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.procs import REPO


def _gen_module() -> object:
    spec = importlib.util.spec_from_file_location("kvcoord_gen_proto", REPO / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kvcoord_gen_proto", module)
    spec.loader.exec_module(module)
    return module


def test_generated_modules_are_current(tmp_path: Path) -> None:
    generate = _gen_module().generate  # type: ignore[attr-defined]
    fresh = {str(p.relative_to(tmp_path)): p.read_bytes() for p in generate(tmp_path)}
    committed = {str(p.relative_to(REPO)): p.read_bytes() for p in (REPO / "kvcoord" / "proto").glob("v*/*")
                 if p.is_file()}
    assert sorted(fresh) == sorted(committed), "generated file set differs: run scripts/gen_proto.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated modules {stale}: run .venv/bin/python scripts/gen_proto.py"
