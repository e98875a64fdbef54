# Sourced by scripts/setup and scripts/test-floors: the one CPU build of torch they install, and how.
TORCH="torch==2.13.0"
CPU_INDEX=https://download.pytorch.org/whl/cpu
# install_cpu_torch PYTHON [--no-deps]: a local CPU wheel (pip's find-links) first, then, unless --no-deps,
# its dependencies from the usual indexes (torch is then already satisfied, so pip cannot swap in the CUDA
# build); else PyTorch's CPU index. Returns non-zero when neither works.
install_cpu_torch() {
  local py=$1 nodeps=${2:-}
  if "$py" -m pip install -q --no-index --no-deps "$TORCH" 2>/dev/null; then
    echo "[torch] installed $TORCH from a local wheel${nodeps:+ (no dependencies)}"
    [ -n "$nodeps" ] || "$py" -m pip install -q "$TORCH"
  else
    echo "[torch] installing $TORCH (CPU build) from $CPU_INDEX"
    "$py" -m pip install -q $nodeps "$TORCH" --index-url "$CPU_INDEX"
  fi
}
