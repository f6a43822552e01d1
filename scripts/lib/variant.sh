# Shared by scripts/sanitize and scripts/test-no-isal: copy the work tree to a
# temp dir and build the C core there with the given build switches, so the
# normal in-place build is untouched. Source it, then:
#   variant_setup NAME            sets $work (removed at exit unless KVTIER_VARIANT_KEEP=1;
#                                 so run the tests, do not exec them)
#   variant_build VAR=VALUE ...   builds kvtier._C in $work with those settings
#   variant_env                   PYTHONPATH=$work, cd $work (the copy is imported first)
variant_setup() {
  src="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  py="${PYTHON:-python}"
  work="$(mktemp -d "${TMPDIR:-/tmp}/kvtier-$1.XXXXXX")"
  trap '[[ "${KVTIER_VARIANT_KEEP:-${KVTIER_SANITIZE_KEEP:-0}}" == 1 ]] || rm -rf "$work"' EXIT
  # Sources: tracked and untracked-not-ignored files, no build products.
  (cd "$src" && git ls-files -z --cached --others --exclude-standard 2>/dev/null || find . -type f -print0) |
    (cd "$src" && xargs -0 -r tar -cf - --no-recursion --ignore-failed-read) | tar -xf - -C "$work"
}

variant_build() {
  echo "$(basename "$0"): building the C core with $* in $work" >&2
  (cd "$work" && env "$@" "$py" setup.py -q build_ext --inplace --build-temp "$work/build" \
     > "$work/build.log" 2>&1) || { cat "$work/build.log" >&2; exit 1; }
}

variant_env() {
  export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"
  cd "$work"
}
