#!/usr/bin/env bash
# Mutation testing of raygpt's core modules: mutmut (the `test` extra) changes one small thing at
# a time in a module (an operator, a constant, a call's argument) and runs the fast tests that
# cover the changed function; a mutant that no test notices "survives". Prints the kill rate per
# module; the survivors and the reason each is equivalent (or the test that now kills it) are
# kept in bench/results/mutants.md.
#
#   bench/mutants.sh                      # every core module (long: an hour or more on 2 cores)
#   bench/mutants.sh schedule outlier     # some of them
#   MUTANTS_DIR=/tmp/x bench/mutants.sh   # scratch directory (default /tmp/raygpt-mutants)
#   MUTANTS_REV=HEAD bench/mutants.sh     # a commit's tree instead of the working tree
#   MUTANTS_ONLY='raygpt.data.loader.x_merge_ranges__mutmut_*' bench/mutants.sh data
#                                         # only the mutants matching these fnmatch patterns
#   MUTANTS_TESTS='tests/test_x.py' bench/mutants.sh data   # another test selection
#
# `loop` is narrowed: only the step's decision functions (agree, update, act_on, rewind,
# broadcast_step, all_reduce_sum in train/loop.py; sampling_step, watch_metrics and
# Validation.due in train/loop_tasks.py) are mutated, against tests/train/test_loop_steps.py
# (stand-ins for the run's components, milliseconds a test). build_run, _train, forward_backward,
# finish and the torch switches are wiring that only a training run exercises: `loop-all` mutates
# the whole of train/loop.py against the loop tests (minutes per mutant: many hours on 2 cores).
# `loop-wiring` mutates those wiring functions (build_model, train, build_run, _train,
# after_first_step, forward_backward, finish in train/loop.py; build_val_loader in
# eval/validation.py) against tests/train/test_loop_wiring.py: one tiny in-process run compared
# with a hand-rolled reference loop (seconds a mutant). evaluate and sample_text, which it also
# checks, are decorated (torch.no_grad): mutmut 3 makes no mutants of a decorated function.
#
# mutmut writes a mutants/ tree next to pyproject.toml, so the script works in a scratch copy of
# the working tree (tracked and untracked-but-not-ignored files), never in the checkout. Each
# module gets its own copy of the configuration ([tool.mutmut] in pyproject.toml) with
# only_mutate narrowed to it and the test selection narrowed to the tests that exercise it (the
# stats pass that maps tests to functions runs every selected test once under tracing).
# Not part of CI: run it by hand, at low priority (nice), after changing a core module.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SCRATCH=${MUTANTS_DIR:-/tmp/raygpt-mutants}
MODULES=("$@")
[ ${#MODULES[@]} -gt 0 ] || MODULES=(schedule outlier optim state data checkpoint state_file loop)

# the fast, Ray-free tests that exercise each module: each module against its own unit tests
# (seconds per mutant). The loop tests reach every core module but cost minutes per mutant, so
# only `loop` uses them; a mutant the unit tests miss but the loop tests would catch is
# counted as survived here, and must get a unit test (or an equivalence reason) of its own.
# Candidate paths that do not exist are dropped (tests move into packages: tests/checkpointing/,
# tests/llmc/), so the selection follows the tree that is being mutated.
LOOP_TESTS="tests/train/test_loop.py tests/train/test_spike.py tests/train/test_training_behaviour.py"
candidates_for() {
  case "$1" in
    schedule)   echo "tests/train/test_schedule.py" ;;
    outlier)    echo "tests/train/test_outlier.py" ;;
    optim)      echo "tests/train/test_optim.py" ;;
    state)      echo "tests/train/test_state.py" ;;
    data)       echo "tests/data/test_loader.py tests/llmc/test_shards.py" ;;
    checkpoint) echo "tests/checkpointing/test_protocol_messages.py tests/checkpointing/test_protocol.py
                      tests/llmc/test_state_file.py" ;;
    loop)       echo "tests/train/test_loop_steps.py" ;;
    loop-all)   echo "$LOOP_TESTS" ;;
    loop-wiring) echo "tests/train/test_loop_wiring.py" ;;
    state_file) echo "tests/llmc/test_state_file.py" ;;
    hashing_writer) echo "tests/storage/test_hashing_writer.py tests/checkpointing/test_snapshot.py" ;;
    *) echo "bench/mutants.sh: unknown module '$1' (expected one of schedule outlier optim state data checkpoint state_file hashing_writer loop loop-wiring loop-all)" >&2
       exit 2 ;;
  esac
}
tests_for() {
  local found=()
  for t in $(candidates_for "$1"); do
    [ -e "$2/$t" ] && found+=("$t")
  done
  [ ${#found[@]} -gt 0 ] || { echo "bench/mutants.sh: no tests found for '$1' in $2" >&2; exit 2; }
  echo "${found[@]}"
}
# the files each module name stands for (the loop's targets span the loop and its tasks)
path_for() {
  case "$1" in
    schedule|outlier|optim|state) echo "raygpt/train/$1.py" ;;
    data)       echo "raygpt/data/loader.py" ;;
    checkpoint) echo "raygpt/checkpointing/protocol.py" ;;
    loop)       echo "raygpt/train/loop.py raygpt/train/loop_tasks.py" ;;
    loop-all)   echo "raygpt/train/loop.py" ;;
    loop-wiring) echo "raygpt/train/loop.py raygpt/eval/validation.py" ;;
    state_file) echo "raygpt/llmc/state_file.py" ;;
    hashing_writer) echo "raygpt/storage/hashing_writer.py" ;;
  esac
}
# the mutants to run (fnmatch patterns over mutmut's names; none: every mutant of the file)
only_for() {
  if [ -n "${MUTANTS_ONLY:-}" ]; then
    echo "$MUTANTS_ONLY"
  elif [ "$1" = loop ]; then
    for f in agree update act_on rewind broadcast_step all_reduce_sum; do
      printf 'raygpt.train.loop.x_%s__mutmut_* ' "$f"
    done
    for f in sampling_step watch_metrics; do
      printf 'raygpt.train.loop_tasks.x_%s__mutmut_* ' "$f"
    done
    echo "raygpt.train.loop_tasks.xǁValidationǁdue__mutmut_*"
  elif [ "$1" = loop-wiring ]; then
    for f in build_model train build_run _train after_first_step forward_backward finish; do
      printf 'raygpt.train.loop.x_%s__mutmut_* ' "$f"
    done
    echo "raygpt.eval.validation.x_build_val_loader__mutmut_*"
  fi
}

summary=()
for mod in "${MODULES[@]}"; do
  work="$SCRATCH/$mod"
  rm -rf "$work" && mkdir -p "$work"
  if [ -n "${MUTANTS_REV:-}" ]; then  # a commit instead of the working tree
    (cd "$ROOT" && git archive "$MUTANTS_REV") | (cd "$work" && tar -xf -)
  else
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard) |
      (cd "$ROOT" && xargs -0 tar -cf - --ignore-failed-read) | (cd "$work" && tar -xf -)
  fi
  tests=${MUTANTS_TESTS:-$(tests_for "$mod" "$work")}
  python3 - "$work/pyproject.toml" "$(path_for "$mod")" $tests <<'PY'
import json, re, sys
path, modules, tests = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
text = open(path).read()
text = re.sub(r"only_mutate = \[[^\]]*\]", "only_mutate = " + json.dumps(modules), text)
text = re.sub(r"pytest_add_cli_args_test_selection = \[[^\]]*\]",
              "pytest_add_cli_args_test_selection = " + json.dumps(tests), text)
open(path, "w").write(text)
PY
  only=$(only_for "$mod")
  echo "== $mod: mutating $(path_for "$mod")${only:+ (only $only)} against: $tests"
  read -r -a patterns <<< "$only"  # one argument per pattern, never glob-expanded by the shell
  # each mutant's pytest keeps its basetemp (the forked runs leave pytest's .lock behind, so its
  # keep-the-last-3 cleanup never runs): with tests that write checkpoints that is ~1 GB a
  # mutant, which filled the disk once. The tmp dirs live in the scratch copy, and a sweeper
  # removes those untouched for 5 minutes (a mutant's tests take well under that)
  mkdir -p "$work/tmp"
  (while sleep 60; do
     find "$work/tmp" -mindepth 2 -maxdepth 2 -name 'pytest-[0-9]*' -mmin +5 -exec rm -rf {} + 2>/dev/null
   done) &
  sweeper=$!
  (cd "$work" && PYTHONPATH="$work" PYTEST_DEBUG_TEMPROOT="$work/tmp" nice -n 19 mutmut run \
     --max-children "${MUTANTS_JOBS:-1}" ${patterns[@]+"${patterns[@]}"} > "$work/run.log" 2>&1) ||
    echo "   mutmut run exited $? (see $work/run.log)"
  kill "$sweeper" 2>/dev/null || true
  rm -rf "$work/tmp"
  (cd "$work" && mutmut results --all true > "$work/results.txt" 2>&1) || true
  line=$(python3 - "$work/results.txt" "$mod" <<'PY'
import collections, sys
path, mod = sys.argv[1], sys.argv[2]
counts = collections.Counter()
for raw in open(path):
    name, sep, status = raw.strip().rpartition(": ")
    if sep and name.startswith("raygpt."):
        counts[status.strip()] += 1
# mutants left out by MUTANTS_ONLY (or the loop's narrowing) stay "not checked": not counted
unchecked = counts.pop("not checked", 0)
total = sum(counts.values())
killed = counts["killed"]
# a mutant the tests never reach ("no tests") or that hangs past mutmut's limit ("timeout": the
# tests noticed, by not finishing) is counted as mutmut counts it: not survived, not killed
detail = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
if unchecked:
    detail += f"; {unchecked} not run"

rate = f"{100 * killed / total:5.1f}%" if total else "  n/a"
print(f"{mod:<11} {killed:4d}/{total:<4d} killed {rate}   ({detail})")
PY
)
  echo "   $line"
  summary+=("$line")
done

echo
echo "module      killed/total        ($(date -u +%Y-%m-%dT%H:%MZ), mutmut $(mutmut --version 2>/dev/null | awk '{print $NF}'))"
printf '%s\n' "${summary[@]}"
echo "survivors: (cd $SCRATCH/<module> && mutmut results; mutmut show <name>)"
