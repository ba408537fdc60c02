# Sourced by the GPU session scripts: stages the package under /tmp/pkg as the installed layout has it
# (the lent GPU machines have no network to pip-install it), puts it on PYTHONPATH, makes $OUT.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -rf /tmp/pkg && mkdir -p /tmp/pkg/autopar
cp -rL autopar/. /tmp/pkg/autopar/   # autopar/{passes,cost_model,kernels,examples} link to the top-level folders
export PYTHONPATH=/tmp/pkg
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
