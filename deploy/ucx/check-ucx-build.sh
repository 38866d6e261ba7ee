#!/bin/sh
# Usage: check-ucx-build.sh PATH/TO/ucx_info
# Exits 0 when the UCX that ucx_info belongs to was built with what the gpu and rdma overlays need,
# read from its build configuration (ucx_info -b): verbs (HAVE_IB) with the rc, dc and ud transports,
# the rdmacm connection manager, and CUDA (cuda_copy, cuda_ipc) as uct modules. Otherwise it names
# what is missing and the configure flags, and exits 1 (2 when ucx_info cannot run). deploy/Dockerfile.cuda
# runs it on the UCX it builds, so an image without RDMA transports is never built.
set -eu
ucx_info="${1:?usage: check-ucx-build.sh PATH/TO/ucx_info}"
if ! config="$("$ucx_info" -b 2>&1)"; then
  echo "check-ucx-build: $ucx_info -b failed: $config" >&2
  exit 2
fi
missing=""
for define in HAVE_IB HAVE_TL_RC HAVE_TL_DC HAVE_TL_UD; do
  printf '%s\n' "$config" | grep -Eq "^#define[[:space:]]+${define}[[:space:]]+1[[:space:]]*\$" || missing="$missing $define"
done
modules="$(printf '%s\n' "$config" | sed -n 's/^#define[[:space:]]*uct_MODULES[[:space:]]*"\(.*\)"[[:space:]]*$/\1/p')"
for module in ib rdmacm cuda; do
  case ":$modules:" in
    *":$module:"*) ;;
    *) missing="$missing uct_MODULES:$module" ;;
  esac
done
flags="$(printf '%s\n' "$config" | sed -n 's/^#define[[:space:]]*UCX_CONFIGURE_FLAGS[[:space:]]*//p')"
if [ -n "$missing" ]; then
  echo "check-ucx-build: $ucx_info: UCX lacks$missing (uct modules \"$modules\"; configure flags $flags)" >&2
  exit 1
fi
echo "check-ucx-build: $ucx_info: verbs (rc, dc, ud), rdmacm and CUDA (uct modules \"$modules\")"
