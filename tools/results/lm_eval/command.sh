# tools/eval/run_lm_eval.sh --limit 10 --check 5
# ran this lm-eval command against capserve on 2 ranks started by tools/with_capserve.py:
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 exec "tools/.venv-lmeval/bin/lm_eval" --model local-completions \
  --model_args "model=$CAPSERVE_MODEL_ID,base_url=$CAPSERVE_BASE_URL/completions,tokenizer_backend=huggingface,tokenizer=deploy/models/capserve-moe-tiny,tokenized_requests=True,num_concurrent=2,max_length=1024" \
  --include_path tools/eval/lm_eval_tasks --tasks capserve_lambada_books,capserve_gsm8k_local --limit 10 \
  --log_samples --output_path "OUTPUT_PATH"
