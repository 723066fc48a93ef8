#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-quantize, llama-server and llama-perplexity (CPU only,
# Release) from the vendor/llama.cpp folder of the llama-cpp-python source distribution.
#
#   bench/build_llamacpp.sh [SRC_DIR] [BUILD_DIR]
#
# SRC_DIR   a llama.cpp source tree (vendor/llama.cpp of the sdist, or a pruned copy of it).
#           Left out: the sdist is fetched with `pip download` into BUILD_DIR/../sdist and unpacked.
# BUILD_DIR default: ./llamacpp-build
#
# Options (environment variables, or the flags given before the positional arguments):
#   LLAMACPP_SAFE=1 | --safe    portable AVX-512 build without AMX:
#                               -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
#                               -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
#                               (llama.cpp's AMX path for quantized types segfaults in some VMs).
#                               Default: -DGGML_NATIVE=ON (whatever this CPU has, AMX included).
#   LLAMACPP_JOBS=N | -j N      parallel compile jobs (default: nproc)
#   LLAMACPP_NICE=N             run the compiler under `nice -n N` (default 0)
#   LLAMACPP_PIP_SPEC=SPEC      what pip downloads when SRC_DIR is left out (default llama-cpp-python)
#
# Nothing is downloaded while building: curl, OpenSSL and the prebuilt web UI are off, so the
# server has no embedded web page (its HTTP API is complete).
set -euo pipefail

SAFE="${LLAMACPP_SAFE:-0}"
JOBS="${LLAMACPP_JOBS:-$(nproc)}"
NICE="${LLAMACPP_NICE:-0}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --safe) SAFE=1; shift ;;
        --native) SAFE=0; shift ;;
        -j) JOBS="$2"; shift 2 ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        --) shift; break ;;
        -*) echo "build_llamacpp.sh: unknown option $1 (see --help)." >&2; exit 2 ;;
        *) break ;;
    esac
done
SRC_DIR="${1:-}"
BUILD_DIR="${2:-$PWD/llamacpp-build}"
mkdir -p "$BUILD_DIR"
BUILD_DIR="$(cd "$BUILD_DIR" && pwd)"

if [[ -z "$SRC_DIR" ]]; then
    SDIST_DIR="$(dirname "$BUILD_DIR")/sdist"
    mkdir -p "$SDIST_DIR"
    echo "== fetching the llama-cpp-python source distribution into $SDIST_DIR"
    python3 -m pip download --no-binary :all: --no-deps --no-build-isolation \
        -d "$SDIST_DIR" "${LLAMACPP_PIP_SPEC:-llama-cpp-python}" \
        || python3 -m pip download --no-binary :all: --no-deps -d "$SDIST_DIR" \
               "${LLAMACPP_PIP_SPEC:-llama-cpp-python}"
    TARBALL="$(ls -t "$SDIST_DIR"/llama_cpp_python-*.tar.gz | head -1)"
    tar -xzf "$TARBALL" -C "$SDIST_DIR"
    SRC_DIR="${TARBALL%.tar.gz}/vendor/llama.cpp"
fi
if [[ ! -f "$SRC_DIR/CMakeLists.txt" || ! -d "$SRC_DIR/ggml" ]]; then
    echo "build_llamacpp.sh: $SRC_DIR is not a llama.cpp source tree (no CMakeLists.txt and ggml/)." >&2
    exit 2
fi
SRC_DIR="$(cd "$SRC_DIR" && pwd)"

if [[ "$SAFE" == 1 ]]; then
    KIND="safe (portable AVX-512 + VNNI + BF16, AMX off)"
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
               -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF)
else
    KIND="native (-march=native)"
    ISA_FLAGS=(-DGGML_NATIVE=ON)
fi
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)

echo "== llama.cpp build: $KIND"
echo "   source: $SRC_DIR"
echo "   build:  $BUILD_DIR   jobs: $JOBS"
nice -n "$NICE" cmake -S "$SRC_DIR" -B "$BUILD_DIR" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DGGML_OPENMP=ON "${ISA_FLAGS[@]}"
nice -n "$NICE" cmake --build "$BUILD_DIR" --config Release -j "$JOBS" \
    --target llama-bench llama-quantize llama-server llama-perplexity

{
    echo "kind: $KIND"
    echo "source: $SRC_DIR"
    echo "flags: ${ISA_FLAGS[*]}"
    [[ -f "$SRC_DIR/../../pyproject.toml" ]] && grep -m1 '^version' "$SRC_DIR/../../pyproject.toml" || true
    "$BUILD_DIR/bin/llama-bench" --version 2>&1 | head -3 || true
} > "$BUILD_DIR/BUILD_INFO.txt"
echo "== done: $KIND"
cat "$BUILD_DIR/BUILD_INFO.txt"
ls -l "$BUILD_DIR"/bin/llama-{bench,quantize,server,perplexity}
