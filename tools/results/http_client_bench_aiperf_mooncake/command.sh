# tools/bench/http_client_bench.sh --mooncake mooncake_synthetic.jsonl --length-scale 0.03125 --trace-start-s 900 --duration-s 60 --time-scale 1
# wrote TRACE.jsonl: capserve-loadgen: wrote TRACE.jsonl: trace mooncake_synthetic.jsonl from 900 s x1.000 (273 requests over 60.0 s), lengths x0.03125, prefixes of 16-token blocks; block size 16 tokens; capped 53 of 273 prompts (24521 tokens cut in all, at most 4957 from one) to --max-prompt-tokens 1024 and the 1024-token context less the output, 0 of 273 outputs to --max-tokens 1024
# ran this aiperf command against capserve on 2 ranks started by tools/with_capserve.py:
HF_HOME="HF_CACHE" HF_HUB_OFFLINE=1 \
exec "tools/.venv-bench/bin/aiperf" profile --model "$CAPSERVE_MODEL_ID" --url "http://127.0.0.1:$CAPSERVE_HTTP_PORT" \
  --endpoint-type completions --streaming --tokenizer capserve/capserve-moe-tiny \
  --input-file "TRACE.jsonl" --custom-dataset-type mooncake_trace --fixed-schedule --isl-block-size 16 \
  --extra-inputs ignore_eos:true --random-seed 0 --ui simple --artifact-dir "ARTIFACT_DIR"
