"""SGLang's own hashing and event code, from its released wheel, for the bit-identity tests.

Nothing of SGLang lives in this repository: the wheel is downloaded (``pip download --no-deps``) into a
cache directory, its ``hash_binding.cpp`` compiled with pybind11 and OpenSSL, and its modules
``sglang.srt.mem_cache.{utils,events}``, ``sglang.srt.disaggregation.kv_events``,
``sglang.srt.lora.lora_registry`` and ``cpp_utils/native_hash.py`` imported from it as they are. Only
their heavy imports (GPU kernels, the runtime context, the network helpers, the package ``__init__``
files) are replaced by empty stand-ins; the extension loader's stand-in returns the extension compiled
here from the wheel's source.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import types
import zipfile
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
_FILES = (
    "sglang/srt/mem_cache/cpp_utils/hash_binding.cpp",
    "sglang/srt/mem_cache/cpp_utils/native_hash.py",
    "sglang/srt/mem_cache/utils.py",
    "sglang/srt/mem_cache/events.py",
    "sglang/srt/mem_cache/evict_policy.py",
    "sglang/srt/disaggregation/kv_events.py",
    "sglang/srt/lora/lora_registry.py",
)


class Unavailable(Exception):
    """The wheel cannot be had here (no network, no index): the reason to skip with."""


def cache_dir() -> Path:
    base = os.environ.get("KVCOORD_TEST_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvcoord-tests")
    return Path(base) / f"sglang-{SGLANG_VERSION}"


def _fetch(root: Path) -> Path:
    """The extracted files of the wheel under ``root/src`` (downloaded and extracted once)."""
    src = root / "src"
    if all((src / f).exists() for f in _FILES):
        return src
    dl = root / "wheel"
    tmp = root / "src.tmp"
    for attempt in (1, 2):  # a wheel cut short by a killed run is downloaded once more
        dl.mkdir(parents=True, exist_ok=True)
        wheels = sorted(dl.glob("sglang-*.whl"))
        if not wheels:
            r = subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                 f"sglang=={SGLANG_VERSION}", "-d", str(dl)],
                capture_output=True, text=True, timeout=900, check=False,
            )
            wheels = sorted(dl.glob("sglang-*.whl"))
            if r.returncode != 0 or not wheels:
                raise Unavailable(f"pip download sglang=={SGLANG_VERSION} failed: {r.stderr.strip()[-300:]}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with zipfile.ZipFile(wheels[0]) as zf:
                for name in _FILES:
                    zf.extract(name, tmp)
            break
        except zipfile.BadZipFile:
            shutil.rmtree(dl, ignore_errors=True)
            if attempt == 2:
                raise
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    return src


def _compile(root: Path, src: Path) -> Path:
    """SGLang's hash_binding.cpp built as a Python extension (pybind11 + OpenSSL's libcrypto)."""
    import pybind11

    name = "sgl_hash_binding"
    out = root / "ext" / (name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "g++")
    cmd = [
        cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-DNDEBUG", f"-DTORCH_EXTENSION_NAME={name}",
        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
        str(src / _FILES[0]), "-o", str(out) + ".tmp", "-lcrypto",
    ]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise Unavailable(f"no C++ compiler {cxx!r} (install g++)") from None
    except subprocess.CalledProcessError as exc:
        tail = exc.stderr.strip()[-500:]
        raise Unavailable(f"compiling SGLang's hash_binding.cpp failed: {tail}") from None
    os.replace(str(out) + ".tmp", out)
    return out


def _stub(name: str, path: Path | None = None, **attrs: Any) -> None:
    mod = types.ModuleType(name)
    if path is not None:
        mod.__path__ = [str(path)]
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod


def load() -> types.SimpleNamespace:
    """SGLang's modules (``utils``, ``events``, ``kv_events``, ``native_hash``, ``lora_registry``) and its
    compiled hash extension (``ext``). Raises :class:`Unavailable` when the wheel cannot be downloaded."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:  # one run at a time fills the shared cache
        fcntl.flock(lock, fcntl.LOCK_EX)
        src = _fetch(root)
        ext_path = _compile(root, src)
    spec = importlib.util.spec_from_file_location("sgl_hash_binding", ext_path)
    assert spec is not None and spec.loader is not None
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    before = set(sys.modules)
    pkg = src / "sglang"
    _stub("sglang", pkg)
    _stub("sglang.srt", pkg / "srt")
    _stub("sglang.srt.utils", pkg / "srt" / "utils", ConcurrentCounter=object)
    _stub("sglang.srt.utils.aio_rwlock", RWLock=object)
    _stub("sglang.kernels", pkg / "kernels")
    _stub("sglang.kernels.ops", pkg / "kernels" / "ops")
    _stub("sglang.kernels.ops.kvcache", pkg / "kernels" / "ops" / "kvcache")
    kernels = {n: None for n in (
        "get_mla_kv_buffer_kernel", "get_mla_kv_buffer_triton", "set_mla_kv_buffer_dcp_sharded_triton",
        "set_mla_kv_buffer_fp8_quant_kernel", "set_mla_kv_buffer_kernel", "set_mla_kv_buffer_triton",
        "set_mla_kv_buffer_triton_fp8_quant", "set_mla_kv_scale_buffer_kernel",
        "set_mla_kv_scale_buffer_triton")}
    _stub("sglang.kernels.ops.kvcache.mla_buffer", **kernels)
    _stub("sglang.srt.environ", envs=types.SimpleNamespace())
    _stub("sglang.srt.runtime_context", get_parallel=lambda: None)
    _stub("sglang.srt.utils.network", NetworkAddress=object)
    _stub("sglang.srt.utils.cpp_extension_loader", load_extension_with_recovery=lambda **_: ext)
    try:
        ns = types.SimpleNamespace(
            ext=ext,
            native_hash=importlib.import_module("sglang.srt.mem_cache.cpp_utils.native_hash"),
            utils=importlib.import_module("sglang.srt.mem_cache.utils"),
            kv_events=importlib.import_module("sglang.srt.disaggregation.kv_events"),
            events=importlib.import_module("sglang.srt.mem_cache.events"),
            lora_registry=importlib.import_module("sglang.srt.lora.lora_registry"),
        )
        ns.native_hash._load_native_hash_module()  # cached now: it imports the loader lazily
    finally:  # keep the loaded modules (held by ns) out of sys.modules: nothing else sees an "sglang"
        for name in set(sys.modules) - before:
            del sys.modules[name]
    return ns
