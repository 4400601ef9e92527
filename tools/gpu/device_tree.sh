#!/usr/bin/env bash
# The device tool copies the checkout to the GPU machine with a 64 MiB limit on what travels (the tracked and
# untracked, not ignored files, plus what is carried: the kit's archive). The kit needs tests/fixtures/models and
# deploy/models/capserve-moe-tiny from the checkout, not the tokenizer goldens nor the other embedded models,
# which take it over the limit. `aside` moves those out of the tree (to ../.capserve-aside) and prints what
# will travel; `back` puts them back (run it right after the device call).
#
# Usage: bash tools/gpu/device_tree.sh aside [CARRIED_FILE...] | back
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
aside="$root/../.capserve-aside"
limit=$((64 * 1024 * 1024))

paths() {
  echo tests/fixtures/tokenizers
  for model in "$root"/deploy/models/*/; do
    [[ "$(basename "$model")" == capserve-moe-tiny ]] || echo "deploy/models/$(basename "$model")"
  done
}

case "${1:-}" in
  aside)
    shift
    mkdir -p "$aside"
    while read -r path; do
      [[ -e "$root/$path" ]] || continue
      mkdir -p "$aside/$(dirname "$path")"
      mv "$root/$path" "$aside/$path"
      echo "aside: $path"
    done < <(paths)
    bytes=$(cd "$root" && { git ls-files -z; git ls-files -z --others --exclude-standard; } |
      { xargs -0 -r stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')  # aside: no stat
    for carried in "$@"; do bytes=$((bytes + $(stat -c %s "$carried"))); done
    echo "travels: $((bytes / 1048576)) MiB of the 64 MiB limit"
    ((bytes <= limit)) || { echo "device_tree.sh: over the limit" >&2; exit 1; }
    ;;
  back)
    [[ -d "$aside" ]] || { echo "device_tree.sh: nothing aside"; exit 0; }
    while IFS= read -r -d '' path; do
      rel="${path#"$aside"/}"
      mkdir -p "$root/$(dirname "$rel")"
      mv "$path" "$root/$rel"
      echo "back: $rel"
    done < <(find "$aside" -mindepth 2 -maxdepth 3 \( -path "$aside/tests/fixtures/*" -o -path "$aside/deploy/models/*" \) -prune -print0)
    find "$aside" -depth -type d -empty -delete
    ;;
  *)
    echo "usage: bash tools/gpu/device_tree.sh aside [CARRIED_FILE...] | back" >&2
    exit 2
    ;;
esac
