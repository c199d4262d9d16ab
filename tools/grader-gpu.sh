#!/usr/bin/env bash
# The grader on a GPU (compiled kernels): its tests, `gpulab grade` on every solution
# (full marks expected) and every learner notebook (0 expected), the mistake catalogue,
# and, when nbgrader is importable, the whole course under nbgrader.
# usage: tools/grader-gpu.sh OUTDIR
# Carry the wheels first: ../shared/gpu/wheels.sh .whl nbgrader  (nbgrader is optional)
set -uo pipefail
out=${1:?usage: tools/grader-gpu.sh OUTDIR}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg CI=true
python3 -m gpulab env | tee "$out/env.txt"
python3 -m pytest -p no:cacheprovider -n 0 -q tests/test_checking.py tests/test_mistakes.py \
  tests/test_grade.py tests/test_grade_nbgrader.py 2>&1 | tee "$out/pytest.txt"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/pytest.txt"
python3 -m gpulab grade solutions/*.ipynb --json "$out/grades-solutions.json" > "$out/grade-solutions.txt" 2>&1
echo "exit $? (0 expected)" >> "$out/grade-solutions.txt"
python3 -m gpulab grade notebooks/*.ipynb --json "$out/grades-learner.json" > "$out/grade-learner.txt" 2>&1
echo "exit $? (1 expected: every exercise a stub)" >> "$out/grade-learner.txt"
python3 -m tests.mistakes.report --json "$out/mistakes.json" > "$out/mistakes.txt" 2>&1
if python3 -c "import nbgrader" 2>/dev/null; then
  python3 -m gpulab.tools.nbgrader_support "$out/nbgrader" > "$out/nbgrader.txt" 2>&1
  echo "exit $?" >> "$out/nbgrader.txt"
fi
tail -n 3 "$out"/*.txt
