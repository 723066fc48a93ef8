"""Build the Cython kernels in cython_kernels/ against oneDNN and install numa_runtime.

Every `cython_kernels/<name>.pyx` becomes the extension `numa_runtime._kernels.<name>`.
oneDNN comes from the `onednn-devel-cpu-gomp` wheel, which puts `libdnnl.so` in
`sys.prefix/lib` and the headers in `sys.prefix/include`.
"""
import glob
import os
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

PREFIX_LIB = os.path.join(sys.prefix, "lib")
PREFIX_INC = os.path.join(sys.prefix, "include")

if not os.path.exists(os.path.join(PREFIX_INC, "dnnl.h")):
    sys.exit("oneDNN headers not found in %s: run `pip install onednn-devel-cpu-gomp==2023.2.0` "
             "before building numa_runtime." % PREFIX_INC)

# NOTE: x86-64-v3 (AVX2/FMA/F16C) is the floor; AVX-512 paths are compiled with target
# attributes and chosen at run time, so one build runs on every machine we target.
COMPILE_ARGS = ["-O3", "-fopenmp", "-march=x86-64-v3", "-mtune=native", "-fno-math-errno", "-fno-trapping-math",
                "-Wno-unused-function", "-Wno-unreachable-code"]
LINK_ARGS = ["-fopenmp", "-Wl,--disable-new-dtags", "-Wl,-rpath," + PREFIX_LIB]


def kernel_extensions():
    exts = []
    for pyx in sorted(glob.glob("cython_kernels/*.pyx")):
        name = os.path.splitext(os.path.basename(pyx))[0]
        exts.append(Extension(
            "numa_runtime._kernels." + name, [pyx],
            include_dirs=[np.get_include(), PREFIX_INC, "cython_kernels"],
            library_dirs=[PREFIX_LIB], libraries=["dnnl"],
            extra_compile_args=COMPILE_ARGS, extra_link_args=LINK_ARGS,
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            language="c"))
    return exts


setup(
    name="numa_runtime",
    version="0.1.0",
    description="CPU-first LLM inference runtime: one MPI rank per NUMA node, tensor parallel",
    packages=find_packages(include=["numa_runtime", "numa_runtime.*", "launch", "cuda_backend"]),
    ext_modules=cythonize(kernel_extensions(), language_level=3,
                          compiler_directives={"boundscheck": False, "wraparound": False,
                                               "cdivision": True, "initializedcheck": False}),
    python_requires=">=3.10",
    install_requires=["numpy", "mpi4py", "mpich", "psutil", "safetensors", "tokenizers", "jinja2",
                      "fastapi", "uvicorn", "prometheus-client", "tqdm", "gguf",
                      "onednn-cpu-gomp==2023.2.0"],
    extras_require={"cuda": ["torch"]},
    entry_points={"console_scripts": ["numa-launch=launch.cli:main",
                                      "numa-serve=numa_runtime.serve.__main__:main"]},
    zip_safe=False,
)
