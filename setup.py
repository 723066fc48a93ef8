"""Build the Cython kernels in cython_kernels/ against oneDNN and install numa_runtime.

Every `cython_kernels/<name>.pyx` becomes the extension `numa_runtime._kernels.<name>`.
oneDNN comes from wheels: `onednn-devel-cpu-gomp` has the headers (`<prefix>/include`) and
depends on `onednn-cpu-gomp`, which has `libdnnl.so` (`<prefix>/lib`). `<prefix>` is this
interpreter's for `python setup.py build_ext --inplace`, and pip's build environment for
`pip install .` / `pip wheel .` (pyproject.toml lists the build requirements).
The top-level `launch/` folder is the package `numa_runtime.launch` (numa_runtime/launch is a
link to it), which the numa-launch command runs.
"""
import glob
import os
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext



def _wheel_file_dir(dist: str, path: str) -> str | None:
    """The directory holding `path` (e.g. "include/dnnl.h") as installed by wheel `dist`."""
    from importlib import metadata
    try:
        files = metadata.distribution(dist).files or ()
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        full = os.path.normpath(str(f.locate()))
        if full.endswith(os.sep + os.path.normpath(path)):
            return os.path.dirname(full)
    return None


ONEDNN_INC = _wheel_file_dir("onednn-devel-cpu-gomp", "include/dnnl.h")
ONEDNN_LIB = _wheel_file_dir("onednn-cpu-gomp", "lib/libdnnl.so")
if ONEDNN_INC is None or ONEDNN_LIB is None:
    sys.exit("oneDNN headers or library not found: run `pip install onednn-devel-cpu-gomp==2023.2.0` "
             "before building numa_runtime.")
# NOTE: at run time libdnnl.so.3 comes from the onednn-cpu-gomp wheel in the environment that
# imports us: $ORIGIN/../../../.. is <prefix>/lib seen from <prefix>/lib/pythonX.Y/site-packages/
# numa_runtime/_kernels. In-place builds in a checkout also get sys.prefix/lib (BuildExt); a
# wheel never does: there sys.prefix may be the build's temporary environment, a path anyone
# could later fill with a library of their own.
RPATHS = ["$ORIGIN/../../../.."]

# NOTE: x86-64-v3 (AVX2/FMA/F16C) is the floor; AVX-512 paths are compiled with target
# attributes and chosen at run time, so one build runs on every machine we target.
COMPILE_ARGS = ["-O3", "-fopenmp", "-march=x86-64-v3", "-fno-math-errno", "-fno-trapping-math",
                "-Wno-unused-function", "-Wno-unreachable-code"]
LINK_ARGS = ["-fopenmp", "-Wl,--disable-new-dtags"] + ["-Wl,-rpath," + p for p in RPATHS]


HEADERS = sorted(glob.glob("cython_kernels/*.h") + glob.glob("cython_kernels/*.pxi"))


def kernel_extensions():
    sources = sorted(glob.glob("cython_kernels/*.pyx"))
    if not sources:  # NOTE: never a wheel without kernels (it fails only when a model runs)
        sys.exit("cython_kernels/*.pyx not found: build numa_runtime from its source tree or a complete sdist.")
    exts = []
    for pyx in sources:
        name = os.path.splitext(os.path.basename(pyx))[0]
        exts.append(Extension(
            "numa_runtime._kernels." + name, [pyx],
            depends=HEADERS,  # NOTE: a changed kernel header rebuilds the extensions
            include_dirs=[np.get_include(), ONEDNN_INC, "cython_kernels"],
            library_dirs=[ONEDNN_LIB], libraries=["dnnl"],
            extra_compile_args=COMPILE_ARGS, extra_link_args=LINK_ARGS,
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            language="c"))
    return exts


class BuildExt(build_ext):
    def run(self):
        # NOTE: setuptools builds an in-place run with inplace off, then copies the files back
        if self.inplace or getattr(self, "editable_mode", False):
            for ext in self.extensions:
                ext.extra_link_args = ext.extra_link_args + ["-Wl,-rpath," + os.path.join(sys.prefix, "lib")]
        super().run()


setup(
    name="numa_runtime",
    cmdclass={"build_ext": BuildExt},
    version="0.1.0",
    description="CPU-first LLM inference runtime: one MPI rank per NUMA node, tensor parallel",
    # NOTE: launch/ and cuda_backend/ install as numa_runtime.launch and numa_runtime.cuda_backend
    # (through the links in numa_runtime/), never as global modules; cuda_backend is imported
    # only for device="cuda", and its dependencies come with the `cuda` extra
    packages=find_packages(include=["numa_runtime", "numa_runtime.*"]),
    ext_modules=cythonize(kernel_extensions(), language_level=3,
                          compiler_directives={"boundscheck": False, "wraparound": False,
                                               "cdivision": True, "initializedcheck": False}),
    python_requires=">=3.10",
    install_requires=["numpy", "mpi4py", "mpich", "psutil", "safetensors", "tokenizers", "jinja2",
                      "fastapi", "uvicorn", "prometheus-client", "tqdm", "gguf", "llguidance", "huggingface_hub",
                      "onednn-cpu-gomp==2023.2.0"],
    extras_require={"cuda": ["torch>=2.4", "triton>=3.0"]},
    entry_points={"console_scripts": ["numa-launch=numa_runtime.launch.cli:main",
                                      "numa-serve=numa_runtime.serve.__main__:main"]},
    zip_safe=False,
)
