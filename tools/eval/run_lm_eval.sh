#!/usr/bin/env bash
# EleutherAI's lm-evaluation-harness (pinned in tools/eval/requirements-lm-eval.txt, venv tools/.venv-lmeval)
# against CapServe's OpenAI-compatible completions endpoint with its `local-completions` model:
#   tools/eval/run_lm_eval.sh [--limit N] [--check K] [--out DIR]
# capserve starts on 2 ranks with the default model (tools/with_capserve.py, --http-port 0); lm-eval runs one
# log-likelihood task (capserve_lambada_books: last-word prediction, echo + logprobs requests) and one generation
# task (capserve_gsm8k_local: zero-shot GSM8K, greedy) on N documents each (default 10), sending token ids
# made with the model's own tokenizer (tokenizer_backend=huggingface on deploy/models/capserve-moe-tiny). Both
# tasks read local data (tools/eval/lm_eval_tasks/, data from ../shared/data by make_lm_eval_data.py) because the
# Hugging Face hub is not reachable. Then the first K (default 5) log-likelihoods lm-eval logged are checked against
# capserve-eval-heldout on the same tokens (compare_lm_eval_heldout.py, 1e-4); the script fails otherwise.
# lm-eval's results JSON and per-document samples, the check's figures and the exact command go to --out (default
# tools/results/lm_eval/). Needs the build's server/capserve, tools/capserve-eval-heldout and
# runtime/tokenizer/capserve-tokenize (build/, or CAPSERVE_BUILD_DIR) and PyPI for the first run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
limit=10 check=5
out="$root/tools/results/lm_eval"
while (($# > 0)); do
  case "$1" in
    --limit) limit="$2" ;;
    --check) check="$2" ;;
    --out) out="$2" ;;
    *) echo "usage: $0 [--limit N] [--check K] [--out DIR]" >&2; exit 2 ;;
  esac
  shift 2
done
build="${CAPSERVE_BUILD_DIR:-$root/build}"
bin="$(bash "$root/tools/setup_venv.sh" .venv-lmeval tools/eval/requirements-lm-eval.txt)"
python3 "$root/tools/eval/make_lm_eval_data.py"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
cd "$root"  # the tasks' data_files are relative to the repository root

# The lm-eval command line, as run (the URL and model name come from the server just started).
model_args="model=\$CAPSERVE_MODEL_ID,base_url=\$CAPSERVE_BASE_URL/completions,tokenizer_backend=huggingface"
model_args+=",tokenizer=deploy/models/capserve-moe-tiny,tokenized_requests=True,num_concurrent=2,max_length=1024"
cat >"$work/client.sh" <<CLIENT
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec "$bin/lm_eval" --model local-completions \\
  --model_args "$model_args" \\
  --include_path tools/eval/lm_eval_tasks --tasks capserve_lambada_books,capserve_gsm8k_local --limit $limit \\
  --log_samples --output_path "$work/lm_eval"
CLIENT
python3 tools/with_capserve.py --build "$build" --counts "$work/server_counts.json" -- bash "$work/client.sh" 2>&1 |
  grep -v '^\[capserve\]' | tee "$work/run.log"
results="$(find "$work/lm_eval" -name 'results_*.json' | head -1)"
[[ -n "$results" ]] || { echo "run_lm_eval: lm-eval wrote no results" >&2; exit 1; }
cp "$results" "$out/results.json"
for task in capserve_lambada_books capserve_gsm8k_local; do
  cp "$(find "$work/lm_eval" -name "samples_${task}_*.jsonl" | head -1)" "$out/samples_$task.jsonl"
done
cp "$work/server_counts.json" "$out/"
sed -n '/^|/p' "$work/run.log" >"$out/results.md"
{
  echo "# tools/eval/run_lm_eval.sh --limit $limit --check $check"
  echo "# ran this lm-eval command against capserve on 2 ranks started by tools/with_capserve.py:"
  sed -e "s#$root/##g" -e "s#$work/lm_eval#OUTPUT_PATH#" "$work/client.sh"
} >"$out/command.sh"
python3 tools/eval/compare_lm_eval_heldout.py --build "$build" --samples "$out/samples_capserve_lambada_books.jsonl" \
  --count "$check" --json "$out/loglikelihood_vs_heldout.json"
