"""Reproducible Horovod install: build horovod 0.28.1 from its PyPI sdist against the venv's torch.

    python -m gloo_patch.install_horovod            # build (or reuse the cached wheel) and install
    python -m gloo_patch.install_horovod --check    # exit 0 if a matching Horovod is installed
    python -m gloo_patch.install_horovod --rebuild  # ignore the cache

Steps (each printed as it happens):
  1. `pip download --no-deps --no-binary :all: horovod==0.28.1` (the sdist, never a prebuilt wheel);
  2. raise the C++ standard from 14 to 17 in the top-level CMakeLists.txt and in
     horovod/torch/CMakeLists.txt (the release forces C++14; PyTorch >= 2.1 headers need C++17), and
     make process-set Gloo contexts honour HOROVOD_GLOO_IFACE (see PATCHES: without it, ranks placed in
     separate network namespaces cannot connect);
  3. `pip wheel --no-build-isolation` with Gloo and PyTorch, without MPI/TensorFlow/MXNet, so the build
     compiles against the torch installed in this interpreter (build isolation would fetch another);
  4. cache the wheel under ~/.cache/ina-emu/wheels/<horovod>-torch<torch>-<python tag>/ and install it;
  5. write the .pth line that applies the INA patch (gloo_patch.autopatch) when INA_SWITCH is set.

A later run finds the cached wheel for the same horovod + torch + python and installs it in seconds.
The cache root can be moved with INA_EMU_CACHE.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
BUILD_ENV = {
    "HOROVOD_WITH_PYTORCH": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_MPI": "1",
    "HOROVOD_WITHOUT_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_GPU_OPERATIONS": "",  # CPU build
}
# Source patches: (file inside the sdist, exact text, replacement, expected count, why).
PATCHES = [
    ("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)", 1,
     "C++14 -> C++17 (PyTorch >= 2.1 headers need C++17)"),
    ("horovod/torch/CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)", 1,
     "C++14 -> C++17 (PyTorch >= 2.1 headers need C++17)"),
    # Horovod 0.28.1 builds the Gloo device of every process set (the global one included, since
    # 0.23) with an empty interface, so inside a network namespace it resolves the hostname to
    # 127.0.0.1 and ranks in different emulated hosts cannot connect: use HOROVOD_GLOO_IFACE there too.
    ("horovod/common/gloo/gloo_context.cc",
     "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
     "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
     "  gloo_iface_ = global_context.gloo_iface_;  // ina-emu: process sets honour HOROVOD_GLOO_IFACE\n"
     "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
     "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;", 1,
     "process-set Gloo contexts use HOROVOD_GLOO_IFACE (ranks in separate network namespaces)"),
]
PATCH_LEVEL = "p2"   # bump when PATCHES change: part of the wheel cache key
MIN_CMAKE = (3, 13)


def log(msg: str) -> None:
    print(f"[install_horovod] {msg}", flush=True)


def torch_version() -> str:
    import torch  # noqa: PLC0415 - only needed here

    return torch.__version__


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def cache_dir() -> Path:
    root = Path(os.environ.get("INA_EMU_CACHE", Path.home() / ".cache" / "ina-emu"))
    key = f"horovod-{HOROVOD_VERSION}{PATCH_LEVEL}-torch{torch_version()}-{python_tag()}"
    return root / "wheels" / key


def cached_wheel() -> Path | None:
    d = cache_dir()
    wheels = sorted(d.glob(f"horovod-{HOROVOD_VERSION}-*.whl")) if d.is_dir() else []
    return wheels[-1] if wheels else None


def installed_ok() -> tuple[bool, str]:
    """True when horovod.torch imports, has the right version and was built with Gloo against this torch."""
    code = (
        "import json, horovod, horovod.torch as hvd, torch\n"
        "print(json.dumps({'v': horovod.__version__, 'gloo': hvd.gloo_built(), 'torch': torch.__version__}))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"horovod.torch does not import: {last}"
    import json  # noqa: PLC0415

    info = json.loads(p.stdout.strip().splitlines()[-1])
    if info["v"] != HOROVOD_VERSION:
        return False, f"horovod {info['v']} installed, want {HOROVOD_VERSION}"
    if not info["gloo"]:
        return False, "installed horovod was built without Gloo"
    stamp = Path(sys.prefix) / ".horovod-built-for"
    want = cache_dir().name
    if not stamp.exists() or stamp.read_text().strip() != want:
        return False, f"installed horovod was not built for {want}"
    return True, f"horovod {info['v']} (gloo, {want}) installed"


def check_cmake() -> str:
    cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (FileNotFoundError, PermissionError):
        out = ""
    m = re.search(r"cmake version (\d+)\.(\d+)", out)
    if m and (int(m.group(1)), int(m.group(2))) >= MIN_CMAKE:
        log(f"cmake {m.group(1)}.{m.group(2)} at {cmake}")
        return cmake
    log("no cmake >= 3.13 on PATH: installing pip's cmake package into the venv")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "cmake>=3.13"], check=True)
    return str(Path(sys.executable).parent / "cmake")


def for_compilers() -> None:
    for tool in ("gcc", "g++", "make"):
        if not shutil.which(tool):
            raise SystemExit(f"[install_horovod] error: `{tool}` not found; install build-essential first")


def download_sdist(workdir: Path) -> Path:
    log(f"downloading the horovod=={HOROVOD_VERSION} sdist from PyPI")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         f"horovod=={HOROVOD_VERSION}", "-d", str(workdir), "-q"],
        check=True,
    )
    sdists = list(workdir.glob(f"horovod-{HOROVOD_VERSION}.tar.gz"))
    if not sdists:
        raise SystemExit(f"[install_horovod] error: pip download left no horovod-{HOROVOD_VERSION}.tar.gz in {workdir}")
    with tarfile.open(sdists[0]) as tf:
        tf.extractall(workdir, filter="data")
    src = workdir / f"horovod-{HOROVOD_VERSION}"
    log(f"unpacked to {src}")
    return src


def patch_sources(src: Path) -> None:
    """Apply PATCHES; checks every file before writing any (all or nothing)."""
    texts: dict[str, str] = {}
    for rel, old, _new, expected, _why in PATCHES:
        text = texts.get(rel) if rel in texts else (src / rel).read_text()
        n = text.count(old)
        if n != expected:
            raise SystemExit(
                f"[install_horovod] error: expected {expected} occurrence(s) of {old.splitlines()[0]!r} in {rel}, "
                f"found {n}; the sdist is not the one these patches were written for"
            )
        texts[rel] = text.replace(old, _new)
    for rel, text in texts.items():
        (src / rel).write_text(text)
    for rel, _old, _new, _expected, why in PATCHES:
        log(f"patched {rel}: {why}")


def build_wheel(src: Path, outdir: Path, cmake: str, log_path: Path) -> Path:
    env = dict(os.environ)
    env.update(BUILD_ENV)
    env["MAKEFLAGS"] = f"-j{os.cpu_count() or 2}"
    env["PATH"] = f"{Path(cmake).parent}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
           "-w", str(outdir), str(src)]
    log(f"building the wheel (about 6 min on 2 cores); full log: {log_path}")
    t0 = time.monotonic()
    pct_re = re.compile(r"\[\s*(\d+)%\]\s+(Building|Linking)\s+\S+\s+\S+\s+(\S+)")
    last_pct = -1
    with open(log_path, "w") as lf:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            m = pct_re.search(line)
            if m:
                pct = int(m.group(1))
                target = m.group(3).rsplit("/", 1)[-1]
                if pct != last_pct or m.group(2) == "Linking":
                    last_pct = pct
                    log(f"  {time.monotonic() - t0:6.0f}s [{pct:3d}%] {m.group(2).lower()} {target}")
            elif "-- Configuring done" in line or "-- Build files have been written" in line:
                log(f"  {time.monotonic() - t0:6.0f}s cmake: {line.strip().lstrip('- ')}")
        rc = proc.wait()
    if rc != 0:
        tail = "".join(open(log_path).readlines()[-40:])
        raise SystemExit(f"[install_horovod] error: wheel build failed (exit {rc}); last lines of {log_path}:\n{tail}")
    wheels = list(outdir.glob(f"horovod-{HOROVOD_VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"[install_horovod] error: build finished but no wheel in {outdir}")
    log(f"wheel built in {time.monotonic() - t0:.0f}s: {wheels[0].name}")
    return wheels[0]


def install_wheel(wheel: Path) -> None:
    log(f"installing {wheel}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)],
                   check=True)
    # then its runtime deps (cloudpickle, cffi, psutil, pyyaml, packaging) from PyPI; torch is not one of them
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", str(wheel)], check=True)
    (Path(sys.prefix) / ".horovod-built-for").write_text(cache_dir().name + "\n")


def install_autopatch_hook() -> None:
    """The .pth line that applies gloo_patch.horovod to unmodified scripts when INA_SWITCH is set."""
    from gloo_patch.autopatch import install_hook  # noqa: PLC0415

    log(f"INA_SWITCH autopatch hook: {install_hook()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gloo_patch.install_horovod", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report whether a matching Horovod is installed")
    ap.add_argument("--rebuild", action="store_true", help="rebuild even if a cached wheel exists")
    ap.add_argument("--keep-build", action="store_true", help="keep the unpacked sdist and build tree")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    ok, why = installed_ok()
    if args.check:
        log(why)
        return 0 if ok else 1
    if ok and not args.rebuild:
        install_autopatch_hook()
        log(f"{why}; nothing to do")
        return 0
    log(f"{why}; installing")

    wheel = None if args.rebuild else cached_wheel()
    if wheel is not None:
        log(f"reusing cached wheel {wheel}")
    else:
        for_compilers()
        cmake = check_cmake()
        target = cache_dir()
        target.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="horovod-build-"))
        try:
            src = download_sdist(work)
            patch_sources(src)
            built = build_wheel(src, work / "dist", cmake, target / "build.log")
            for old in target.glob("*.whl"):
                old.unlink()
            wheel = target / built.name
            shutil.copy2(built, wheel)
            log(f"cached {wheel}")
        finally:
            if args.keep_build:
                log(f"build tree kept at {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
    install_wheel(wheel)
    ok, why = installed_ok()
    if not ok:
        raise SystemExit(f"[install_horovod] error: after install: {why}")
    install_autopatch_hook()
    log(f"{why} ({time.monotonic() - t_start:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
