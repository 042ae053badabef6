"""Build gograph: gopy compiles the Go core into one CPython extension per flavor.

- cpu flavor (`gograph._core_cpu`): always built; no CUDA code.
- cuda flavor (`gograph._core_cuda`): the same Go package with `-tags cuda` (own cgo capture
  calls + gorgonia.org/cu), built when a cuda.h that gorgonia.org/cu compiles against is found
  (see build_support/cudastub.py). GOGRAPH_CUDA=1 makes a missing header an error,
  GOGRAPH_CUDA=0 skips the flavor.

Needs Go and a C compiler on PATH (build_support/prereqs.py); gopy and goimports are installed
from the versions pinned in go.mod (tools/tools.go) into .tools/ when missing. A tree with
``vendor/`` (an sdist) builds without network: every Go module, gopy included, comes from it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from build_support.cudastub import build_link_stub, find_cuda_header  # noqa: E402
from build_support.flavors import remove_flavor, write_go_shim  # noqa: E402
from build_support.prereqs import PrereqError, check_build  # noqa: E402

log = logging.getLogger("gograph.build")
GO_PACKAGE = "./gograph"
GOPY_NAME = "gographcore"


class GopyExtension(Extension):
    """An extension built by `gopy build` rather than from C sources."""

    def __init__(self, name: str, flavor: str):
        super().__init__(name, sources=[])
        self.flavor = flavor


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("gograph build: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=HERE, env=env, check=True)


def _require_go() -> str:
    """Go and a C compiler, checked before anything is built (build_support/prereqs.py): an old
    Go otherwise fails deep in the build with ``go.mod: invalid go version``. One line, no
    traceback, when one is missing."""
    try:
        return check_build()
    except PrereqError as e:
        raise SystemExit(f"error: {e}") from None


def _offline_env(env: dict[str, str]) -> dict[str, str]:
    """A source tree with ``vendor/`` (every sdist: ``make sdist`` vendors the Go modules, gopy
    and goimports included) builds without the Go module proxy: the go command reads ``vendor/``,
    and a ``go`` shim first on PATH turns gopy's hard-coded ``go build -mod=mod`` into
    ``-mod=vendor``. A checkout without ``vendor/`` builds from the module cache as usual."""
    if not (HERE / "vendor" / "modules.txt").exists():
        return env
    shim = write_go_shim(HERE / "_gopy_build" / "gobin", shutil.which("go", path=env.get("PATH")) or "go")
    env = dict(env, GOFLAGS=(env.get("GOFLAGS", "") + " -mod=vendor").strip(), GOTOOLCHAIN="local")
    env["PATH"] = os.pathsep.join([str(shim.parent), env.get("PATH", "")])
    return env


def _ensure_tools(go: str) -> Path:
    """gopy and goimports at the versions go.mod pins (the module proxy refuses
    `go install gopy@v0.4.10`, so they are installed through the module's own requirements)."""
    tools = HERE / ".tools"
    if not ((tools / "gopy").exists() and (tools / "goimports").exists()):
        env = _offline_env(dict(os.environ, GOBIN=str(tools)))
        _run([go, "install", "github.com/go-python/gopy", "golang.org/x/tools/cmd/goimports"], env)
    return tools


class BuildGopy(build_ext):
    def run(self) -> None:
        self._go = _require_go()  # before anything is built: one line when Go or cc is missing
        choice = os.environ.get("GOGRAPH_CUDA", "").strip()
        if choice not in ("", "0", "1"):
            raise RuntimeError(f"GOGRAPH_CUDA must be 0, 1 or unset, not {choice!r}")
        self._cuda_header = None
        if choice != "0":
            header, notes = find_cuda_header()
            if header is None:
                msg = "no usable cuda.h for the CUDA flavor:\n  " + "\n  ".join(notes)
                if choice == "1":
                    raise RuntimeError(
                        msg + "\nset GOGRAPH_CUDA_INCLUDE to a CUDA 11.8-12.x include "
                        "folder or `pip install nvidia-cuda-runtime-cu12`"
                    )
                print("gograph build: skipping the CUDA flavor; " + msg, flush=True)
            self._cuda_header = header
        if self._cuda_header is None:
            skipped = [e for e in self.extensions if getattr(e, "flavor", None) == "cuda"]
            self.extensions = [e for e in self.extensions if e not in skipped]
            self._remove_skipped(skipped)
        super().run()

    def _remove_skipped(self, skipped: list[Extension]) -> None:
        """A flavor this build skips must not ship from an earlier build: its extension and
        wrappers are removed from build/ (what ``pip install .`` packs) and, in place, from the
        source tree."""
        build_py = self.get_finalized_command("build_py")
        for ext in skipped:
            package = ext.name.rsplit(".", 1)[0]
            dirs = [Path(self.build_lib, *package.split("."))]
            if self.inplace:
                dirs.append(Path(build_py.get_package_dir(package)))
            for d in dirs:
                for f in remove_flavor(d):
                    print(f"gograph build: removed {f} (the {ext.flavor} flavor is not built)", flush=True)

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, GopyExtension):
            return super().build_extension(ext)
        go = self._go
        tools = _ensure_tools(go)
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(tools), str(Path(go).parent), env.get("PATH", "")])
        env = _offline_env(env)
        # gopy overwrites CGO_CFLAGS/CGO_LDFLAGS with Python's; extra paths go through
        # CGO_CPPFLAGS and LIBRARY_PATH, which it leaves alone.
        args = []
        if ext.flavor == "cuda":
            header = self._cuda_header
            stub = build_link_stub(header, HERE / "_gopy_build" / "cudastub")
            env["CGO_CPPFLAGS"] = (env.get("CGO_CPPFLAGS", "") + f" -I{header.include_dir}").strip()
            env["LIBRARY_PATH"] = os.pathsep.join(p for p in [str(stub.parent), env.get("LIBRARY_PATH", "")] if p)
            args.append("-build-tags=cuda")
            print(
                f"gograph build: CUDA flavor against {header.include_dir}/cuda.h (CUDA_VERSION {header.version})",
                flush=True,
            )
        # gopy's output folder must lie inside the Go module, and a leading "_" keeps the
        # generated main package out of `go list ./...`.
        out = HERE / "_gopy_build" / f"{sysconfig.get_config_var('SOABI')}-{ext.flavor}"
        shutil.rmtree(out, ignore_errors=True)
        _run(
            [
                str(tools / "gopy"),
                "build",
                f"-output={out}",
                f"-vm={sys.executable}",
                f"-name={GOPY_NAME}",
                "-rename=true",
                "-dynamic-link=true",
                "-no-make",
                "-no-warn",
                "-symbols=false",  # -ldflags="-s -w" and -s for the C link: a stripped extension
                *args,
                GO_PACKAGE,
            ],
            env,
        )
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out / f"_{GOPY_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}", dest)
        # gopy names the wrapper after the Go package (gograph.py); it imports `_gographcore`
        # and `go` relative to its own package, so it can be renamed to the extension's name.
        shutil.copy2(out / "gograph.py", dest.parent / f"{GOPY_NAME}.py")
        shutil.copy2(out / "go.py", dest.parent / "go.py")

    def copy_extensions_to_source(self) -> None:
        # `--inplace` builds in build/ and copies only the .so back; the generated wrappers
        # must travel with it.
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            if not isinstance(ext, GopyExtension):
                continue
            package = ext.name.rsplit(".", 1)[0]
            src_dir = Path(self.build_lib, *package.split("."))
            dest_dir = Path(build_py.get_package_dir(package))
            for f in (f"{GOPY_NAME}.py", "go.py"):
                shutil.copy2(src_dir / f, dest_dir / f)


setup(
    package_dir={"": "python"},
    packages=[
        "gograph",
        *(f"gograph.{folder}" for folder in ("probes", "build", "replay", "request", "runtime", "core", "support")),
        "gograph._core_cpu",
        "gograph._core_cuda",
        "gograph.integrations",
    ],
    package_data={
        "gograph": ["py.typed"],
        "gograph.core": ["*.pyi"],
        "gograph._core_cpu": ["*.py"],
        "gograph._core_cuda": ["*.py"],
    },
    ext_modules=[
        GopyExtension(f"gograph._core_cpu._{GOPY_NAME}", "cpu"),
        GopyExtension(f"gograph._core_cuda._{GOPY_NAME}", "cuda"),
    ],
    cmdclass={"build_ext": BuildGopy},
    zip_safe=False,
)
