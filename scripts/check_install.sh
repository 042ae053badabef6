#!/usr/bin/env bash
# Reproduces the install path's failure modes cheaply, without downloading torch: each check
# sets up the situation (a fake old `go`, no `go`, a venv of another CPython, a stale CUDA
# flavor in build/) and shows what gograph says. `--full` also builds the sdist and a wheel from
# it with the Go module proxy switched off and an empty module cache (a few minutes, needs .venv
# with the build requirements: `make venv`).
#
#   bash scripts/check_install.sh          # the quick checks (seconds)
#   bash scripts/check_install.sh --full   # and the offline sdist -> wheel build
#
# Exits non-zero when a check does not behave as documented (README "Install",
# docs/TROUBLESHOOTING.md).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-.venv/bin/python}
test -x "$PY" || PY=$(command -v python3)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
FAILED=0

say() { printf '\n== %s\n' "$*"; }
ok() { printf '   ok: %s\n' "$*"; }
bad() { printf '   FAILED: %s\n' "$*"; FAILED=1; }
# make -n (nothing runs) with a PATH of our own, a venv that does not exist yet, and $1 as PATH head.
make_n() {
  local head=$1; shift
  env -u GO -u PYTHON PATH="$head:$(dirname "$(command -v make)"):/usr/bin:/bin" \
    make -n --no-print-directory VENV="$TMP/venv" "$@" 2>&1
}

say "the distribution name: torch-gograph is free, gograph is another project"
if out=$("$PY" -m pip index versions torch-gograph 2>&1); then
  bad "torch-gograph exists on the index: $out"
elif grep -q "No matching distribution" <<<"$out"; then
  ok "pip index versions torch-gograph: no such distribution (yet)"
else
  echo "   skipped (no package index reachable): ${out##*$'\n'}"
fi

say "an old Go stops make demo in one line, before the venv and torch"
mkdir -p "$TMP/oldgo" && printf '#!/bin/sh\necho go1.19.8\n' >"$TMP/oldgo/go" && chmod +x "$TMP/oldgo/go"
out=$(make_n "$TMP/oldgo" PYTHON="$PY" demo)
echo "   $out"
[[ $(grep -c . <<<"$out") == 1 && $out == *"needs go >= 1.26"* && ! -e $TMP/venv ]] && ok "one line" || bad "expected one line naming go1.19.8"

say "no Go on PATH"
mkdir -p "$TMP/nogo"
out=$(make_n "$TMP/nogo" PYTHON="$PY" demo)
echo "   $out"
[[ $out == *"needs the Go toolchain"* ]] && ok "named" || bad "expected the missing Go named"

say "PYTHON of another CPython than the existing venv's is refused with what to do"
mkdir -p "$TMP/venv" "$TMP/go" && printf 'version = 3.9.0\n' >"$TMP/venv/pyvenv.cfg"
printf '#!/bin/sh\necho go1.26.0\n' >"$TMP/go/go" && chmod +x "$TMP/go/go"
out=$(make_n "$TMP/go" PYTHON="$PY" demo)
echo "   $out"
[[ $out == *"was made with CPython 3.9"*"rm -rf"* ]] && ok "refused" || bad "expected a refusal naming both versions"
rm -rf "$TMP/venv"

say "no GPU: torch's CPU wheels are suggested, and TORCH_INDEX_URL reaches pip (with its progress bar)"
out=$(make_n "$TMP/go" PYTHON="$PY" TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu venv)
grep '"torch==' <<<"$out" | sed 's/^/   /'
[[ $out == *"--progress-bar on --index-url https://download.pytorch.org/whl/cpu"* ]] && ok "passed to pip" || bad "TORCH_INDEX_URL not passed"
if [[ ! -e /dev/nvidiactl ]] && ! command -v nvidia-smi >/dev/null; then
  out=$(make_n "$TMP/go" PYTHON="$PY" venv)
  [[ $out == *"TORCH_INDEX_URL="* ]] && ok "suggested: $(grep -o 'note:.*' <<<"$out")" || bad "no suggestion"
fi

say "GOGRAPH_CUDA=0 removes the CUDA flavor an earlier build left in build/"
mkdir -p "$TMP/src/python/gograph"/{_core_cpu,_core_cuda} "$TMP/src/build/lib/gograph/_core_cuda" "$TMP/fail"
cp -r setup.py pyproject.toml README.md LICENSE go.mod build_support "$TMP/src/"
touch "$TMP/src/python/gograph/"{__init__.py,py.typed,_core_cpu/__init__.py,_core_cuda/__init__.py}
touch "$TMP/src/build/lib/gograph/_core_cuda/"{__init__.py,_gographcore.cpython-312-x86_64-linux-gnu.so,gographcore.py,go.py}
printf '#!/bin/sh\n[ "$1 $2" = "env GOVERSION" ] && { echo go1.26.0; exit 0; }\nexit 3\n' >"$TMP/fail/go" && chmod +x "$TMP/fail/go"
(cd "$TMP/src" && GOGRAPH_CUDA=0 PATH="$TMP/fail:$PATH" "$ROOT/$PY" setup.py build_ext --build-lib=build/lib >"$TMP/flavor.log" 2>&1)
grep "removed" "$TMP/flavor.log" | sed 's/^/   /'
left=$(ls "$TMP/src/build/lib/gograph/_core_cuda")
[[ $left == "__init__.py" ]] && ok "only __init__.py is left" || bad "left: $left"

if [[ ${1:-} == --full ]]; then
  say "the sdist builds with no network for Go (GOPROXY=off, an empty module cache)"
  mkdir -p "$TMP/dist" "$TMP/modcache" "$TMP/wheel"
  (trap 'rm -rf vendor' EXIT; go mod vendor && "$PY" setup.py -q sdist -d "$TMP/dist" >"$TMP/sdist.log" 2>&1) || { cat "$TMP/sdist.log"; bad "sdist"; }
  ls -s "$TMP"/dist/*.tar.gz | sed 's/^/   /'
  (cd "$TMP" && GOPROXY=off GOMODCACHE="$TMP/modcache" GOSUMDB=off \
    "$ROOT/$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$TMP/wheel" "$TMP"/dist/*.tar.gz >"$TMP/wheel.log" 2>&1) \
    && ok "built $(ls "$TMP/wheel")" || { tail -20 "$TMP/wheel.log"; bad "offline wheel build"; }
  [[ -z $(ls -A "$TMP/modcache") ]] && ok "the module cache stayed empty" || bad "modules were fetched"
fi

say "$([[ $FAILED == 0 ]] && echo "all checks behaved as documented" || echo "some checks FAILED")"
exit $FAILED
