#!/usr/bin/env bash
# The sanitizer step (CI: .ci/run). Builds kvcoord's C extensions with AddressSanitizer and
# UndefinedBehaviorSanitizer into a scratch copy of the project (the editable build in kvcoord/ is left
# alone), then runs against that build, under the ASan runtime:
#   - the native-vs-Python tests: tests/test_hashing.py, tests/index/test_index_memory.py, tests/test_native.py
#     (the defect regressions) and the mirror walk's test_c_mirror_walk_is_the_python_walk;
#   - a bounded fuzz of every native function fed from the network or Redis (python -m tests.test_native).
# Any sanitizer report aborts the process, and so fails this script. Needs gcc (or $CC) with libasan and
# libubsan (Debian: gcc, which depends on both), the Python headers, and the test extras installed.
#
# Environment: PYTHON (default: python3 of the active venv), CC (gcc), KVCOORD_FUZZ_SECONDS (40),
# KVCOORD_FUZZ_ITERATIONS (4000: rounds of 40 calls each, spread over the fuzzed functions).
set -euo pipefail
py=${PYTHON:-python3}
case $py in */*) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac # absolute: we cd below
cd "$(dirname "$0")/.."
root=$PWD
cc=${CC:-gcc}
fuzz_seconds=${KVCOORD_FUZZ_SECONDS:-40}
fuzz_iterations=${KVCOORD_FUZZ_ITERATIONS:-4000}
start=$SECONDS

say() { echo "sanitize: $*" >&2; }
command -v "$cc" >/dev/null 2>&1 || { say "no C compiler ($cc)"; exit 1; }
asan_lib=$("$cc" -print-file-name=libasan.so)
[ -e "$asan_lib" ] || { say "$cc has no libasan.so (Debian: apt-get install gcc)"; exit 1; }

scratch=$(mktemp -d "${TMPDIR:-/tmp}/kvcoord-sanitize.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
repo=$scratch/repo
mkdir "$repo"
# The project as this tree has it (committed or not), without build outputs; tests read ../shared.
cp -R kvcoord tests setup.py pyproject.toml README.md LICENSE "$repo/"
find "$repo" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
if [ -d "$root/../shared" ]; then ln -s "$(cd "$root/../shared" && pwd)" "$scratch/shared"; fi

say "building the C extensions with -fsanitize=address,undefined ($("$cc" -dumpfullversion))"
export CC="$cc"
export CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
export LDFLAGS="-fsanitize=address,undefined"
KVCOORD_REQUIRE_SPEEDUPS=1 "$py" -m pip wheel -q --no-deps --no-cache-dir -w "$scratch/wheel" "$repo" \
  >"$scratch/build.log" 2>&1 || { cat "$scratch/build.log" >&2; say "sanitized build failed"; exit 1; }
unset CFLAGS LDFLAGS
# only the compiled modules: the sources are the scratch copy's own
(cd "$repo" && "$py" - "$scratch"/wheel/*.whl <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    names = [n for n in whl.namelist() if n.startswith("kvcoord/") and n.endswith(".so")]
    assert names, "the wheel has no compiled module"
    whl.extractall(".", names)
    print("sanitize: built", ", ".join(names), file=sys.stderr)
EOF
)
for so in "$repo"/kvcoord/_native.*.so; do
  grep -q -a __asan_report "$so" && grep -q -a __ubsan_handle "$so" \
    || { say "$so is not instrumented"; exit 1; }
done

cd "$repo"
export LD_PRELOAD="$asan_lib${LD_PRELOAD:+:$LD_PRELOAD}"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1
export PYTHONMALLOC=malloc # Python objects in malloc'd memory, which ASan watches (not pymalloc arenas)
export KVCOORD_REQUIRE_SPEEDUPS=1 KVCOORD_NATIVE=1
unset PYTHONPATH
run=()
if ! "$py" -c pass 2>/dev/null; then
  # ASan's shadow memory can collide with a randomised mapping on kernels with high mmap entropy
  command -v setarch >/dev/null 2>&1 && setarch "$(uname -m)" -R "$py" -c pass \
    || { say "the ASan runtime does not start: $("$py" -c pass 2>&1 | head -3)"; exit 1; }
  run=(setarch "$(uname -m)" -R)
  say "running without address-space randomisation (setarch -R)"
fi
"${run[@]}" "$py" - "$repo" <<'EOF'
import ctypes, sys
import kvcoord.native
mod = kvcoord.native.native
assert mod is not None and mod.__file__.startswith(sys.argv[1]), mod
ctypes.CDLL(None).__asan_init  # the ASan runtime is loaded
print("sanitize: testing", mod.__file__, file=sys.stderr)
EOF

say "native-vs-Python tests under ASan/UBSan"
# --capture=sys: a sanitizer writes its report to fd 2, which must reach the log even when it aborts
"${run[@]}" "$py" -m pytest -q -p no:cacheprovider --capture=sys \
  tests/test_hashing.py tests/index/test_index_memory.py tests/test_native.py tests/coordinator/test_fastpath.py \
  "tests/index/redis/test_redis_mirror.py::test_c_mirror_walk_is_the_python_walk"

say "fuzz (at most ${fuzz_seconds}s / ${fuzz_iterations} rounds)"
"${run[@]}" "$py" -m tests.test_native --seconds "$fuzz_seconds" --iterations "$fuzz_iterations"
say "passed in $((SECONDS - start))s"
