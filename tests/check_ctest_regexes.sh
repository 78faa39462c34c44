#!/usr/bin/env bash
# Fails where a test's PASS/FAIL/SKIP_REGULAR_EXPRESSION holds a ';': CTest splits the property
# into a list of regexes there, any one of which passes the test (and one that does not compile is
# no check at all). Reads every CTestTestfile.cmake under the build directory whole (a regex may
# hold a newline, or an escaped quote, before its ';').
# Usage: check_ctest_regexes.sh BUILD_DIR
set -euo pipefail
[[ -d "${1:-}" ]] || { echo "usage: check_ctest_regexes.sh BUILD_DIR" >&2; exit 2; }
files=$(find "$1" -name CTestTestfile.cmake -print0 | xargs -0 grep -lzE 'REGULAR_EXPRESSION "([^"\\]|\\.)*;' || true)
if [[ -n "$files" ]]; then
  echo "a REGULAR_EXPRESSION property with a ';' (write '.' for it) in:" >&2
  echo "$files" >&2
  exit 1
fi
echo "no test regex split by a ';' ($(find "$1" -name CTestTestfile.cmake | wc -l) CTestTestfile.cmake files)"
