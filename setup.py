"""`pip install .`: the Python package memascend, its extension built by CMake.

    python3 -m venv --system-site-packages .venv    # Debian's PyTorch stays visible
    .venv/bin/pip install --no-build-isolation .    # offline: this machine's setuptools

build_ext configures the CMake project (Release, the Python package on; tests, benchmarks
and examples off) and builds only the extension's target. libmemascend is linked into the
extension statically (BUILD_SHARED_LIBS=OFF), so the wheel holds one shared object that
needs no libmemascend at run time. Environment:

  MEMASCEND_WITH_CUDA        ON, OFF or AUTO (default: AUTO, CUDA when nvcc is found)
  MEMASCEND_CMAKE_BUILD_DIR  a CMake build directory to use (and reuse); default: one
                             under setuptools' build_temp
  CMAKE_ARGS                 more arguments for the CMake configure step
  CMAKE_BUILD_PARALLEL_LEVEL jobs of the build (CMake's own variable)
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def project_version():
    """The version of CMakeLists.txt's project(MemAscend VERSION x.y.z)."""
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        m = re.search(r"project\(\s*MemAscend\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if not m:
        raise RuntimeError("CMakeLists.txt: no project(MemAscend VERSION ...) found")
    return m.group(1)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.path.abspath(os.environ.get("MEMASCEND_CMAKE_BUILD_DIR") or
                                    os.path.join(self.build_temp, "cmake"))
        cuda = os.environ.get("MEMASCEND_WITH_CUDA", "AUTO")
        configure = ["cmake", "-S", ROOT, "-B", build_dir,
                     "-DCMAKE_BUILD_TYPE=Release",
                     f"-DMEMASCEND_WITH_CUDA={cuda}",
                     "-DMEMASCEND_BUILD_PYTHON=ON",
                     f"-DPython3_EXECUTABLE={sys.executable}",
                     "-DMEMASCEND_BUILD_TESTS=OFF",
                     "-DMEMASCEND_BUILD_BENCH=OFF",
                     "-DMEMASCEND_BUILD_EXAMPLES=OFF",
                     "-DBUILD_SHARED_LIBS=OFF"]
        fresh = not os.path.exists(os.path.join(build_dir, "CMakeCache.txt"))
        if fresh and "CMAKE_GENERATOR" not in os.environ and shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        build = ["cmake", "--build", build_dir, "--target", "memascend_python"]
        if self.parallel:
            build += ["-j", str(self.parallel)]
        self.announce(f"configuring {build_dir}", level=2)
        subprocess.run(configure, check=True)
        subprocess.run(build, check=True)

        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built = os.path.join(build_dir, "python", "memascend", "_core" + suffix)
        if not os.path.exists(built):
            raise RuntimeError(f"{built} was not built (the CMake build in {build_dir} is for "
                               "another Python, or found no pybind11: Debian: pybind11-dev)")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built, target)
        shutil.copymode(built, target)


setup(
    version=project_version(),
    packages=["memascend", "memascend.torch"],
    package_dir={"": "python"},
    package_data={"memascend": ["py.typed", "_core.pyi"], "memascend.torch": ["optimizer.pyi"]},
    ext_modules=[CMakeExtension("memascend._core")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
