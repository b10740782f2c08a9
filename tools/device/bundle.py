#!/usr/bin/env python3
"""Makes the device bundle: what a bare GPU machine needs to run `./run device`.

    bundle.py --build BUILD --source SRC --out .device

From a CUDA build tree (`./run device-prep` makes it) this stages, under build/ at the
same relative paths: every executable and the Python package (stripped), the CTest files
with the build's and the source's absolute paths replaced by placeholders (check.py puts
the GPU machine's paths back), and into OUT/lib/ every shared library they need that a
GPU machine's image lacks (Abseil, fmt, liburing, libnuma, OpenBLAS, ...). Each ELF file
gets a relative RPATH ($ORIGIN/...) to lib/, so nothing needs LD_LIBRARY_PATH. The staged
tree (about 100 MiB: some forty statically linked programs with CUDA code for two
architectures, and OpenBLAS's 37 MiB) is packed into OUT/bundle.tar.xz (about 12 MiB);
check.py unpacks it on the GPU machine in a second or two. OUT/manifest.json says what was
built from which commit, and the sizes.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys

# Libraries every Linux machine (and CUDA's driver) provides; never shipped. libstdc++
# and libgcc_s come with the compiler runtime of any image that has PyTorch.
SYSTEM = re.compile(r"^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|"
                    r"libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libnvidia)")
PLACEHOLDER_BUILD = "@MEMASCEND_BUILD@"
PLACEHOLDER_SOURCE = "@MEMASCEND_SOURCE@"
PLACEHOLDER_CMAKE = "@MEMASCEND_CMAKE@"
PLACEHOLDER_PYTHON = "@MEMASCEND_PYTHON@"
LIMIT = 64 << 20


def is_elf(path):
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def wanted(rel, path):
    """The build tree's files a test run needs."""
    parts = rel.split(os.sep)
    if "CMakeFiles" in parts or "_deps" in parts:
        return False
    name = parts[-1]
    if name == "CTestTestfile.cmake" or name.endswith(("_include.cmake", "_tests.cmake")):
        return True
    # The package as installed: its modules and its type hints (py.typed, the stubs),
    # which test_core.py checks are beside the modules.
    if parts[0] == "python" and (name.endswith((".py", ".pyi")) or name == "py.typed"):
        return True
    if name.endswith((".a", ".o")):
        return False
    return is_elf(path) and (os.access(path, os.X_OK) or name.endswith(".so"))


def needed_libraries(path):
    """(soname, resolved path) of each shared library `path` loads that is not SYSTEM."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    libs = []
    for line in out.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(\S+)", line)
        if not m:
            continue
        soname, resolved = m.groups()
        if resolved == "not":
            sys.exit(f"bundle: {path} needs {soname}, which is not found here")
        if not SYSTEM.match(soname):
            libs.append((soname, resolved))
    return libs


def set_rpath(path, lib_dir):
    rel = os.path.relpath(lib_dir, os.path.dirname(path))
    rpath = "$ORIGIN" if rel == "." else f"$ORIGIN/{rel}"
    subprocess.run(["patchelf", "--set-rpath", rpath, path], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cmake", default=shutil.which("cmake") or "/usr/bin/cmake")
    ap.add_argument("--python", default="", help="the interpreter the build's Python tests name")
    a = ap.parse_args()
    build, source, out = (os.path.realpath(p) for p in (a.build, a.source, a.out))
    # Its own outputs, not .device/deepspeed (tools/device/deepspeed_bundle.py's).
    for name in os.listdir(out) if os.path.isdir(out) else ():
        if name != "deepspeed":
            path = os.path.join(out, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    stage = os.path.join(out, "stage")
    out_build, out_lib = os.path.join(stage, "build"), os.path.join(stage, "lib")
    os.makedirs(out_lib)

    elves, libs = [], {}
    for root, dirs, files in os.walk(build):
        dirs[:] = [d for d in dirs if d != "CMakeFiles"]
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, build)
            if not wanted(rel, path):
                continue
            dst = os.path.join(out_build, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if name.endswith(".cmake"):
                text = open(path).read()
                # The build lies under the source: its prefix goes first.
                text = text.replace(build, PLACEHOLDER_BUILD).replace(source, PLACEHOLDER_SOURCE)
                text = text.replace(a.cmake, PLACEHOLDER_CMAKE)
                if a.python:
                    text = text.replace(a.python, PLACEHOLDER_PYTHON)
                open(dst, "w").write(text)
            elif is_elf(path):
                shutil.copy2(path, dst)
                subprocess.run(["strip", "--strip-unneeded", dst], check=True)
                elves.append(dst)
                for soname, resolved in needed_libraries(path):
                    libs[soname] = resolved
            else:
                shutil.copy2(path, dst)
    for soname, resolved in sorted(libs.items()):
        dst = os.path.join(out_lib, soname)
        shutil.copy2(resolved, dst)
        subprocess.run(["strip", "--strip-unneeded", dst], check=True)
        elves.append(dst)
    for path in elves:
        set_rpath(path, out_lib)
    python_extension = next(iter(sorted(
        f for f in os.listdir(os.path.join(out_build, "python", "memascend"))
        if f.startswith("_core") and f.endswith(".so"))), "")

    size = 0
    for root, _, files in os.walk(stage):
        size += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    archive = os.path.join(out, "bundle.tar.xz")
    subprocess.run(["tar", "-C", stage, "-I", "xz -T0 -6", "-cf", archive, "build", "lib"], check=True)
    shutil.rmtree(stage)
    packed = os.path.getsize(archive)

    def git(*args):
        r = subprocess.run(["git", "-C", source, *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    manifest = {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_type": "Release",
        "cuda_architectures": "80;90",
        "python": python_extension,
        "libraries": sorted(libs),
        "executables": len(elves) - len(libs),
        "bytes": size,
        "archive": os.path.basename(archive),
        "archive_bytes": packed,
        "placeholders": {"build": PLACEHOLDER_BUILD, "source": PLACEHOLDER_SOURCE,
                         "cmake": PLACEHOLDER_CMAKE, "python": PLACEHOLDER_PYTHON},
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"bundle: {archive}: {packed / 2**20:.1f} MiB ({size / 2**20:.1f} MiB unpacked), "
          f"{manifest['executables']} programs, {len(libs)} libraries ({', '.join(sorted(libs))})")
    if packed > LIMIT:
        sys.exit(f"bundle: {packed / 2**20:.1f} MiB is over the {LIMIT >> 20} MiB a device call carries")


if __name__ == "__main__":
    main()
