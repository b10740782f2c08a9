#!/usr/bin/env python3
"""DeepSpeed 0.14.5 for the GPU machine: what bench/gpu/compare.py's
deepspeed-zero-infinity row imports there (issue 40). Nothing of it is committed.

    deepspeed_bundle.py build [--out .device/deepspeed]   # on a development machine
    deepspeed_bundle.py env                                # shell exports for this python3
    deepspeed_bundle.py check [--build-ops]                # on the GPU machine: what it finds

`./run device-prep --deepspeed` runs `build`. The GPU machines have Python 3.12 and
PyTorch 2.11 but no package registry, so the bundle carries, in .device/deepspeed/:

  python/deepspeed/   DeepSpeed v0.14.5 from its git tag, in the layout `pip install` gives
                      (setup.py copies accelerator/ into the package, op_builder/ and csrc/
                      into deepspeed/ops/, where op_builder/builder.py looks for the JIT
                      sources) and git_version_info_installed.py as setup.py writes it with
                      no op prebuilt: cpu_adam and async_io build on first use (ninja)
  python/hjson.py     a json-backed hjson (DeepSpeed reads its config with hjson.load/loads)
  fallback/pydantic/  Debian's python3-pydantic 1.10.4 (pure Python; 0.14.5 is the last
                      release on pydantic v1, and takes pydantic.v1 from a pydantic 2)
  fallback/cpuinfo/   Debian's python3-cpuinfo 5.0.0 (pure Python: py-cpuinfo)
  fallback/tqdm/      Debian's python3-tqdm 4.64.1 (transformers brings its own; Debian's
                      python3 here lacks it)
  bin/ninja           Debian's ninja-build (libc and libstdc++ only): torch's JIT needs it
  include/libaio.h, lib/libaio.so, lib/libaio.so.1   Debian's libaio-dev and libaio1
  env.sh              `. .device/deepspeed/env.sh`: the environment below, for a shell
  manifest.json       the sources (tag, commit, Debian package versions), the sizes

The environment (environ() here, which tools/device/check.py gives bench-gpu's workers,
or env.sh): python/ first on PYTHONPATH; a fallback/ directory only where the interpreter
cannot import that module itself (a pydantic 2 already there serves as pydantic.v1);
bin/ at the end of PATH only where no ninja is on it; include/ on CPATH and lib/ on
LIBRARY_PATH (gcc reads both: async_io's libaio probe, a distutils test link against
-laio, and its JIT build) and LD_LIBRARY_PATH (the built op loads libaio.so.1). No
symbolic links: every file is a copy, so the tree survives any carry.
"""
import argparse
import glob
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUNDLE = os.path.join(ROOT, ".device", "deepspeed")
TAG = "v0.14.5"
MIRROR = "/work/.mirror/deepspeedai+DeepSpeed/repo"
# module -> the Debian package its fallback/<module>/<module> comes from
FALLBACK = {"pydantic": "python3-pydantic", "cpuinfo": "python3-cpuinfo", "tqdm": "python3-tqdm"}
DEBS = (*FALLBACK.values(), "libaio1", "libaio-dev", "ninja-build")
# What of DeepSpeed's tree a run needs: the package, and what setup.py copies into it.
TREE = ("deepspeed", "accelerator", "op_builder", "csrc", "LICENSE", "version.txt")
# Inside deepspeed/: nothing a ZeRO run imports or builds from.
PRUNE_SUFFIXES = (".md", ".png", ".jpg", ".gif", ".pdf")

HJSON = '''"""hjson for DeepSpeed 0.14.5, backed by json (tools/device/deepspeed_bundle.py wrote
it into the device bundle). DeepSpeed reads its config with hjson.load(f,
object_pairs_hook=...) and hjson.loads(s) (deepspeed/runtime/config.py), its autotuner
with hjson.load; strict JSON is what bench/gpu/compare.py hands it (a dict, in fact). Not
Hjson: no comments, no unquoted strings."""
import json

__version__ = "3.1.0+json"
HjsonDecodeError = json.JSONDecodeError


def loads(s, object_pairs_hook=None, **kw):
    return json.loads(s, object_pairs_hook=object_pairs_hook, **kw)


def load(fp, object_pairs_hook=None, **kw):
    return json.load(fp, object_pairs_hook=object_pairs_hook, **kw)


def dumps(obj, **kw):
    return json.dumps(obj, **kw)


def dump(obj, fp, **kw):
    return json.dump(obj, fp, **kw)


dumpsJSON, dumpJSON = dumps, dump
'''

ENV_SH = r'''# DeepSpeed 0.14.5's bundle (tools/device/deepspeed_bundle.py wrote it): source it from
# bash (`. .device/deepspeed/env.sh`; another shell: name the bundle in DS_BUNDLE); the
# same as deepspeed_bundle.environ(). DS_PYTHON: the interpreter the fallbacks are probed
# with (default python3).
_ds=${DS_BUNDLE:-$(cd "$(dirname "${BASH_SOURCE:-$0}")" && pwd)}
export PYTHONPATH="$_ds/python${PYTHONPATH:+:$PYTHONPATH}"
for _m in @FALLBACK@; do
  "${DS_PYTHON:-python3}" -c "import $_m" 2>/dev/null || PYTHONPATH="$PYTHONPATH:$_ds/fallback/$_m"
done
command -v ninja >/dev/null 2>&1 || { chmod +x "$_ds/bin/ninja" 2>/dev/null; export PATH="${PATH:+$PATH:}$_ds/bin"; }
export CPATH="${CPATH:+$CPATH:}$_ds/include"
export LIBRARY_PATH="${LIBRARY_PATH:+$LIBRARY_PATH:}$_ds/lib"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$_ds/lib"
export DS_SKIP_CUDA_CHECK="${DS_SKIP_CUDA_CHECK:-1}"
unset _ds _m
'''


def _append(env, key, value, first=False):
    old = env.get(key)
    env[key] = value if not old else (f"{value}:{old}" if first else f"{old}:{value}")


def environ(bundle=BUNDLE, base=None, has_module=None, has_ninja=None):
    """(env, notes): `base` (os.environ) with the bundle added as the module docstring says;
    `notes` says what was added and why, for the check's summary. has_module(name) and
    has_ninja() probe this interpreter and PATH unless given."""
    env = dict(os.environ if base is None else base)
    if has_module is None:
        def has_module(name):
            return importlib.util.find_spec(name) is not None
    if has_ninja is None:
        def has_ninja():
            return shutil.which("ninja", path=env.get("PATH")) is not None
    _append(env, "PYTHONPATH", os.path.join(bundle, "python"), first=True)
    fallbacks = [m for m in FALLBACK if not has_module(m)]
    for m in fallbacks:
        _append(env, "PYTHONPATH", os.path.join(bundle, "fallback", m))
    ninja = not has_ninja()
    if ninja:
        _append(env, "PATH", os.path.join(bundle, "bin"))
        try:  # a carry that lost the mode bits
            os.chmod(os.path.join(bundle, "bin", "ninja"), 0o755)
        except OSError:
            pass
    _append(env, "CPATH", os.path.join(bundle, "include"))
    for key in ("LIBRARY_PATH", "LD_LIBRARY_PATH"):
        _append(env, key, os.path.join(bundle, "lib"))
    env.setdefault("DS_SKIP_CUDA_CHECK", "1")
    notes = {"bundle": bundle, "fallbacks": fallbacks, "ninja_from_bundle": ninja}
    try:
        with open(os.path.join(bundle, "manifest.json")) as f:
            notes["deepspeed"] = json.load(f).get("deepspeed")
    except (OSError, ValueError):
        pass
    return env, notes


def write_env_sh(bundle):
    with open(os.path.join(bundle, "env.sh"), "w") as f:
        f.write(ENV_SH.replace("@FALLBACK@", " ".join(FALLBACK)))


# ---- build ---------------------------------------------------------------------------
def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def fetch_debs(cache):
    """The Debian packages' files, from `apt-get download` into `cache` (kept: a rebuild
    needs no network). Returns {package: (version, extracted root)}."""
    os.makedirs(cache, exist_ok=True)
    out = {}
    for pkg in DEBS:
        debs = glob.glob(os.path.join(cache, f"{pkg}_*.deb"))
        if not debs:
            subprocess.run(["apt-get", "download", pkg], cwd=cache, check=True,
                           stderr=subprocess.DEVNULL)
            debs = glob.glob(os.path.join(cache, f"{pkg}_*.deb"))
        deb = sorted(debs)[-1]
        version = subprocess.run(["dpkg-deb", "-f", deb, "Version"], capture_output=True,
                                 text=True, check=True).stdout.strip()
        arch = subprocess.run(["dpkg-deb", "-f", deb, "Architecture"], capture_output=True,
                              text=True, check=True).stdout.strip()
        root = os.path.join(cache, "x", pkg)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        run(["dpkg-deb", "-x", deb, root])
        out[pkg] = {"version": version, "architecture": arch, "deb": os.path.basename(deb),
                    "root": root}
    return out


def copy_python(src, dst):
    """A pure-Python package's .py files (and py.typed), nothing compiled."""
    for dirpath, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith((".so", ".pyc", ".pyx", ".c")):
                sys.exit(f"deepspeed_bundle: {os.path.join(dirpath, name)}: not pure Python")
            if name.endswith(".py") or name == "py.typed":
                target = os.path.join(dst, os.path.relpath(dirpath, src), name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(os.path.join(dirpath, name), target)


def deepspeed_tree(mirror, tag, python):
    """DeepSpeed's package at `tag` into python/deepspeed, laid out as installed."""
    commit = run(["git", "-C", mirror, "rev-parse", f"{tag}^{{commit}}"], capture_output=True,
                 text=True).stdout.strip()
    data = run(["git", "-C", mirror, "archive", "--format=tar", commit, *TREE],
               capture_output=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            if sys.version_info >= (3, 12):
                tar.extractall(tmp, filter="tar")
            else:
                tar.extractall(tmp)
        pkg = os.path.join(python, "deepspeed")
        # setup.py's layout: the links deepspeed/accelerator, deepspeed/ops/op_builder and
        # deepspeed/ops/csrc (into ../accelerator, ../../op_builder, ../../csrc) become copies.
        shutil.copytree(os.path.join(tmp, "deepspeed"), pkg, symlinks=False,
                        ignore=shutil.ignore_patterns("__pycache__", *("*" + s for s in PRUNE_SUFFIXES)))
        for link in ("accelerator", os.path.join("ops", "op_builder"), os.path.join("ops", "csrc")):
            assert os.path.isdir(os.path.join(pkg, link)) and \
                not os.path.islink(os.path.join(pkg, link)), link
        version = open(os.path.join(tmp, "version.txt")).read().strip()
        shutil.copy2(os.path.join(tmp, "LICENSE"), os.path.join(pkg, "LICENSE"))
    # setup.py writes this; with no op prebuilt (installed_ops all False) every op is built
    # by JIT on first use, and torch_info is only read for prebuilt ops.
    with open(os.path.join(pkg, "git_version_info_installed.py"), "w") as f:
        f.write("# Written by tools/device/deepspeed_bundle.py as DeepSpeed's setup.py would.\n"
                f"version='{version}'\ngit_hash='{commit[:8]}'\ngit_branch='{tag}'\n"
                "installed_ops = {}  # every reader asks installed_ops.get(name, False)\n"
                "accelerator_name = ''\n"
                "torch_info = {'version': '0.0', 'bf16_support': False, 'cuda_version': '0.0', "
                "'nccl_version': '0.0', 'hip_version': '0.0'}\n")
    return {"version": version, "tag": tag, "commit": commit, "source": mirror}


def size_of(path):
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                sys.exit(f"deepspeed_bundle: {p} is a link")
            total += os.path.getsize(p)
            files += 1
    return total, files


def build(a):
    out = os.path.realpath(a.out)
    if not os.path.isdir(a.mirror):
        sys.exit(f"deepspeed_bundle: no DeepSpeed git repository at {a.mirror} "
                 f"(clone https://github.com/deepspeedai/DeepSpeed and name it with --mirror)")
    debs = fetch_debs(a.debs)
    stage = out + ".new"
    shutil.rmtree(stage, ignore_errors=True)
    python = os.path.join(stage, "python")
    os.makedirs(python)
    manifest = {"deepspeed": deepspeed_tree(a.mirror, a.tag, python), "debian": {}}
    with open(os.path.join(python, "hjson.py"), "w") as f:
        f.write(HJSON)
    dist = "usr/lib/python3/dist-packages"
    for module, pkg in FALLBACK.items():
        copy_python(os.path.join(debs[pkg]["root"], dist, module),
                    os.path.join(stage, "fallback", module, module))
    lib, include, bindir = (os.path.join(stage, d) for d in ("lib", "include", "bin"))
    for d in (lib, include, bindir):
        os.makedirs(d)
    multiarch = "usr/lib/x86_64-linux-gnu"
    real = os.path.realpath(os.path.join(debs["libaio1"]["root"], multiarch, "libaio.so.1"))
    shutil.copy2(real, os.path.join(lib, "libaio.so.1"))
    shutil.copy2(real, os.path.join(lib, "libaio.so"))  # for -laio; its SONAME is libaio.so.1
    shutil.copy2(os.path.join(debs["libaio-dev"]["root"], "usr/include/libaio.h"), include)
    shutil.copy2(os.path.join(debs["ninja-build"]["root"], "usr/bin/ninja"), bindir)
    write_env_sh(stage)
    for pkg, d in debs.items():
        manifest["debian"][pkg] = {k: d[k] for k in ("version", "architecture", "deb")}
    size, files = size_of(stage)
    manifest.update(bytes=size, files=files, built_by="tools/device/deepspeed_bundle.py build")
    with open(os.path.join(stage, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(stage, out)
    print(f"deepspeed_bundle: {out}: DeepSpeed {manifest['deepspeed']['version']} "
          f"({manifest['deepspeed']['commit'][:10]}), "
          + ", ".join(f"{p} {d['version']}" for p, d in manifest["debian"].items())
          + f"; {size / 2**20:.1f} MiB in {files} files")


# ---- env, check ----------------------------------------------------------------------
def shell_env(a):
    env, notes = environ(a.bundle)
    for key in ("PYTHONPATH", "PATH", "CPATH", "LIBRARY_PATH", "LD_LIBRARY_PATH",
                "DS_SKIP_CUDA_CHECK"):
        if env.get(key) != os.environ.get(key):
            print(f"export {key}='{env[key]}'")
    print(f"# {json.dumps(notes)}")


PROBE = r'''
import json, os, shutil, sys, sysconfig, traceback
r = {"python": sys.version.split()[0], "cc": sysconfig.get_config_var("CC"),
     "c++": shutil.which("c++"), "g++": shutil.which("g++"), "nvcc": shutil.which("nvcc"),
     "ninja": shutil.which("ninja")}
for m in ("torch", "numpy", "packaging", "psutil", "tqdm", "pynvml", "setuptools",
          "distutils", "pydantic", "cpuinfo", "hjson"):
    try:
        mod = __import__(m)
        r[m] = getattr(mod, "__version__", None) or getattr(mod, "VERSION", None) or "yes"
        r[m + "_file"] = getattr(mod, "__file__", None)
    except Exception as e:
        r[m] = f"missing: {type(e).__name__}: {e}"
try:
    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    r["deepspeed"] = deepspeed.__version__
    r["deepspeed_file"] = deepspeed.__file__
    from deepspeed.accelerator import get_accelerator
    r["accelerator"] = get_accelerator()._name
    r["async_io_compatible"] = bool(AsyncIOBuilder().is_compatible(verbose=True))
    r["cpu_adam_compatible"] = bool(CPUAdamBuilder().is_compatible(verbose=True))
    if "--build-ops" in sys.argv:
        import time
        for b in (CPUAdamBuilder(), AsyncIOBuilder()):
            t0 = time.time()
            try:
                b.load(verbose=True)
                r[b.NAME + "_built"] = f"ok in {time.time() - t0:.1f} s"
            except BaseException as e:
                r[b.NAME + "_built"] = f"{type(e).__name__}: {str(e)[-2000:]}"
except Exception as e:
    r["deepspeed"] = f"{type(e).__name__}: {e}"
    r["traceback"] = traceback.format_exc()[-3000:]
print(json.dumps(r))
'''


def check(a):
    """What this machine has for DeepSpeed, with the bundle's environment, as one JSON
    line (the last); --build-ops builds cpu_adam and async_io (JIT) too."""
    env, notes = environ(a.bundle)
    cmd = [sys.executable, "-c", PROBE] + (["--build-ops"] if a.build_ops else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    sys.stderr.write(p.stdout[:-1].rpartition("\n")[0] + "\n" + p.stderr[-6000:])
    line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "{}"
    try:
        r = json.loads(line)
    except ValueError:
        r = {"error": f"no result (exit {p.returncode})"}
    r["environ"] = notes
    print(json.dumps(r, indent=1))
    return 0 if str(r.get("deepspeed", "")).startswith("0.14.5") else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build", help="make the bundle (a development machine, Debian)")
    b.add_argument("--out", default=BUNDLE)
    b.add_argument("--mirror", default=os.environ.get("DEEPSPEED_GIT", MIRROR),
                   help="a git repository of DeepSpeed with the tag (env DEEPSPEED_GIT)")
    b.add_argument("--tag", default=TAG)
    b.add_argument("--debs", default=os.path.join(ROOT, ".cache", "deepspeed-debs"),
                   help="where apt-get download leaves the Debian packages (kept)")
    for name, helptext in (("env", "shell exports for this python3"),
                           ("check", "import deepspeed with the bundle, as JSON")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--bundle", default=BUNDLE)
        if name == "check":
            s.add_argument("--build-ops", action="store_true",
                           help="also build cpu_adam and async_io (JIT, a minute or two)")
    a = ap.parse_args()
    if a.what == "build":
        build(a)
    elif a.what == "env":
        shell_env(a)
    else:
        return check(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
