# Sourced by tools/gpu-suite.sh and tools/gpu-bench.sh on an offline GPU host: installs the
# carried wheels (.whl/: nbval & co., from ../shared/gpu/wheels.sh; .peers/: FlashInfer and
# the other peers, from ../shared/gpu/peers.sh) into /tmp/site and sets the environment
# every process needs (NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and its twins).
# once per set of carried wheels (a script that runs the suite and benchmarks side by side
# sources this first, so that they do not install into /tmp/site at the same time)
stamp=/tmp/site/.installed-$(ls .whl .peers 2>/dev/null | md5sum | cut -c1-12)
if [ ! -e "$stamp" ]; then
  for d in .whl .peers; do
    if ls $d/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $d/*.whl
    fi
  done
  mkdir -p /tmp/site && touch "$stamp"
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# A Triton cache packed by an earlier session (tools/gpu-suite.sh with PACK_CACHE=1, carried
# as .tritoncache/): unpacked once into an empty cache, so that kernels whose source did not
# change are not compiled again (compiling is most of a compiled test run's time).
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if ls .tritoncache/triton-cache.tar.xz.part* >/dev/null 2>&1 && [ -z "$(ls -A "$cache" 2>/dev/null)" ]; then
  mkdir -p "$cache" && cat .tritoncache/triton-cache.tar.xz.part* | tar -xJ -C "$cache" \
    && echo "unpacked a carried Triton cache: $(ls "$cache" | wc -l) kernels"
fi
