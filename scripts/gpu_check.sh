#!/usr/bin/env bash
# The GPU check: ucp's `gpu` tests and the GPU benchmark on a machine with one (or more) CUDA GPUs, in under 8 minutes.
#
#   scripts/gpu_check.sh [--wheels DIR] [--size 6GiB] [--repeats 2] [--quick] [--device cpu]
#                        [--tests-timeout 250] [--bench-budget 150]
#
# The time: the tests are stopped after --tests-timeout seconds, the benchmark stops measuring after --bench-budget
# (and is stopped 70 s later): about 6 minutes in all expected, 8 at the most.
# (--device cpu: a smoke run of this script on a machine without a GPU: the gpu tests skip, the figures mean nothing.)
# Needs a Python whose torch sees a GPU (torch with CUDA installed there). The project is used from this checkout
# (PYTHONPATH), not installed. Whatever else it needs and the Python lacks (zarr, crc32c, s3fs, safetensors, pytest,
# ...) is installed from a directory of wheels when one is given (--wheels DIR, or UCP_WHEELS, or ./wheels or
# shared/wheels where present), without the network: on a machine that has it, `pip download -d wheels
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 zarr
# numcodecs crc32c s3fs` makes one for the GPU machine's Python (give its version: wheels of crc32c and numcodecs are
# built per version; `.[test]` would bring torch too), with kvikio-cu13 (or -cu12, as torch's CUDA is) to have kvikio
# measured.
# Writes to $OUT (default ./gpu-check): gpu-tests.xml and gpu-tests.log (pytest), bench-gpu.json and bench-gpu.txt
# (python -m bench_io gpu), collectives.json (with two or more GPUs: NCCL), and gpu-check.json, a summary of it all,
# which it also prints.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${OUT:-$repo/gpu-check}
wheels=${UCP_WHEELS:-}
size=6GiB
repeats=2
device=cuda
tests_timeout=250
bench_budget=150
bench_timeout=220
while [ $# -gt 0 ]; do
    case $1 in
        --wheels) wheels=$2; shift 2 ;;
        --size) size=$2; shift 2 ;;
        --repeats) repeats=$2; shift 2 ;;
        --quick) size=512MiB; repeats=1; shift ;;
        --device) device=$2; shift 2 ;;
        --tests-timeout) tests_timeout=$2; shift 2 ;;
        --bench-budget) bench_budget=$2; bench_timeout=$(( $2 + 70 )); shift 2 ;;
        *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
started=$(date +%s)
# A setup that fails (no GPU, wheels missing) skips the checks, but the summary is written all the same, saying why.
setup_error=""
fail_setup() {
    setup_error=$1
    echo "gpu_check: $1" >&2
}

if [ "$device" = cuda ] && ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    fail_setup "$python's torch sees no GPU ($("$python" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1))"
fi

# What the checks import, by module and the distribution that provides it: those the Python lacks come from the wheels.
missing=$("$python" - <<'EOF'
import importlib.util
needs = {"zarr": "zarr", "numcodecs": "numcodecs", "crc32c": "crc32c", "fsspec": "fsspec", "s3fs": "s3fs",
         "safetensors": "safetensors", "ml_dtypes": "ml_dtypes", "yaml": "pyyaml", "tqdm": "tqdm", "numpy": "numpy",
         "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(dist for module, dist in needs.items() if importlib.util.find_spec(module) is None))
EOF
)
if [ -z "$wheels" ]; then
    for candidate in wheels shared/wheels; do
        if [ -d "$candidate" ]; then wheels=$candidate; break; fi
    done
fi
if [ -n "$missing" ] && [ -z "$setup_error" ]; then
    if [ -z "$wheels" ] || [ ! -d "$wheels" ]; then
        fail_setup "this Python lacks $missing: give a directory of wheels (--wheels DIR)"
    else
        echo "gpu_check: installing $missing from $wheels"
        # shellcheck disable=SC2086  # (a list of distribution names)
        "$python" -m pip install -q --no-index --find-links "$wheels" $missing \
            || fail_setup "pip could not install $missing from $wheels"
    fi
fi
# kvikio is optional: measured where it imports (installed from the wheels when one is there)
if [ -n "$wheels" ] && ! "$python" -c 'import kvikio' 2>/dev/null; then
    for wheel in "$wheels"/kvikio*.whl; do
        [ -e "$wheel" ] || continue
        echo "gpu_check: installing $(basename "$wheel")"
        "$python" -m pip install -q --no-index --find-links "$wheels" "$wheel" || echo "gpu_check: kvikio not installed" >&2
        break
    done
fi

gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
gpu=$("$python" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")')
echo "gpu_check: $gpus x $gpu, torch $("$python" -c 'import torch; print(torch.__version__, torch.version.cuda)')"

# 1. the gpu tests (trainer runs included). At the time limit pytest is interrupted (SIGINT), not killed: it then
# still writes the report of the tests it ran (the one interrupted is left out), and the summary says it was stopped.
tests_rc=skipped
tests_s=0
if [ -z "$setup_error" ]; then
    t0=$(date +%s)
    timeout -s INT -k 30 "$tests_timeout" "$python" -m pytest -p no:cacheprovider -q -m gpu tests/test_gpu.py \
        --timeout 150 --junitxml="$out/gpu-tests.xml" -o junit_family=xunit1 2>&1 | tee "$out/gpu-tests.log"
    tests_rc=${PIPESTATUS[0]}
    tests_s=$(( $(date +%s) - t0 ))
fi

# 2. the benchmark: a device-resident state against the floors and the alternatives, and the trainer's step time
# (it writes its JSON once the media are measured and again after the trainer runs: a stop at the limit keeps the first)
bench_rc=skipped
bench_s=0
if [ -z "$setup_error" ]; then
    t0=$(date +%s)
    timeout -k 10 "$bench_timeout" "$python" -m bench_io gpu --device "$device" --size "$size" --repeats "$repeats" \
        --dirs /dev/shm --trainer-steps 20 --trainer-every 5 --budget-s "$bench_budget" --json "$out/bench-gpu.json" \
        2>&1 | tee "$out/bench-gpu.txt"
    bench_rc=${PIPESTATUS[0]}
    bench_s=$(( $(date +%s) - t0 ))
fi

# 3. NCCL collectives, where two GPUs make a world
collectives_rc=skipped
if [ -z "$setup_error" ] && [ "$gpus" -ge 2 ]; then
    timeout 60 "$python" -m bench_io collectives --worlds 2 --backend nccl --max-bytes 64MiB \
        --json "$out/collectives.json" 2>&1 | tail -20
    collectives_rc=${PIPESTATUS[0]}
fi

"$python" - "$out" "$tests_rc" "$tests_s" "$bench_rc" "$bench_s" "$collectives_rc" "$started" "$setup_error" <<'EOF'
import json, sys, time, xml.etree.ElementTree as ET
from pathlib import Path
out, tests_rc, tests_s, bench_rc, bench_s, collectives_rc, started, setup_error = sys.argv[1:]
out = Path(out)
def code(rc):
    return int(rc) if rc.lstrip("-").isdigit() else rc
summary = {"tests": {"exit": code(tests_rc), "seconds": int(tests_s)}, "bench": {"exit": code(bench_rc), "seconds": int(bench_s)},
           "collectives": collectives_rc, "total_seconds": int(time.time()) - int(started)}
if setup_error:
    summary["setup_error"] = setup_error
for part, rc in (("tests", tests_rc), ("bench", bench_rc)):
    if rc in ("124", "137"):
        summary[part]["stopped"] = "at its time limit: what it had not finished is missing"
try:
    suite = ET.parse(out / "gpu-tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = [(c.get("classname", "") + "::" + c.get("name", ""),
              "failed" if c.find("failure") is not None or c.find("error") is not None
              else "skipped" if c.find("skipped") is not None else "passed")
             for c in suite.iter("testcase") if c.get("name")]  # (an interrupted test has no name there)
    summary["tests"]["cases"] = dict(cases)
    summary["tests"]["counts"] = {k: sum(1 for _, s in cases if s == k) for k in ("passed", "failed", "skipped")}
except (OSError, ET.ParseError, AttributeError) as e:
    summary["tests"]["error"] = f"no test report: {e}"
try:
    bench = json.loads((out / "bench-gpu.json").read_text())
    summary["machine"] = bench["machine"]
    summary["bench"]["medians"] = [{k: m[k] for k in ("phase", "method", "medium", "total_s", "gb_s", "blocking_s", "n")}
                                   for m in bench["medians"]]
    summary["bench"]["trainer"] = bench.get("trainer")
    summary["bench"]["notes"] = bench.get("notes")
except (OSError, ValueError, KeyError) as e:
    summary["bench"]["error"] = f"no benchmark report: {e}"
(out / "gpu-check.json").write_text(json.dumps(summary, indent=1))
print()
print(f"gpu_check summary ({summary['total_seconds']} s): tests {summary['tests'].get('counts', summary['tests'])}, "
      f"exit {tests_rc} in {tests_s} s; benchmark exit {bench_rc} in {bench_s} s; collectives {collectives_rc}")
if setup_error:
    print(f"  setup failed, nothing checked: {setup_error}")
for part in ("tests", "bench"):
    if "stopped" in summary[part]:
        print(f"  {part} stopped {summary[part]['stopped']}")
for name, state in summary["tests"].get("cases", {}).items():
    if state != "passed":
        print(f"  {state}: {name}")
for m in summary["bench"].get("medians", []):
    total = f"{m['total_s']:.3f} s" if m["total_s"] else "-"
    blocking = f", blocking {m['blocking_s']:.4f} s" if m["blocking_s"] is not None else ""
    print(f"  {m['phase']:<4} {m['method']:<21} {m['medium']:<5} {total}{blocking}")
print(f"  trainer: {summary['bench'].get('trainer')}")
print(f"written: {out}/gpu-check.json")
EOF
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
