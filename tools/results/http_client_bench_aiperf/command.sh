# tools/bench/http_client_bench.sh --requests 100 --concurrency 8 --isl 64 --osl 32
# ran this aiperf command against capserve on 2 ranks started by tools/with_capserve.py:
exec "tools/.venv-bench/bin/aiperf" profile --model "$CAPSERVE_MODEL_ID" --url "http://127.0.0.1:$CAPSERVE_HTTP_PORT" \
  --endpoint-type chat --streaming --tokenizer "deploy/models/capserve-moe-tiny" \
  --request-count 100 --concurrency 8 \
  --isl 64 --isl-stddev 0 --osl 32 --osl-stddev 0 --extra-inputs ignore_eos:true \
  --random-seed 0 --ui simple --artifact-dir "ARTIFACT_DIR"
