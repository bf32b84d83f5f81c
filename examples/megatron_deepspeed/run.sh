#!/bin/bash
# Megatron-DeepSpeed's own pretrain_gpt.py with the flags of its MoE examples (examples_deepspeed/MoE/
# ds_pretrain_gpt_125M_MoE64.sh, scaled down), on 2 CPU ranks, with or without the hecate key; see README.md.
#   usage: run.sh MEGATRON_DEEPSPEED_DIR DATA_PREFIX OUT_DIR ZERO_STAGE HECATE(0|1) [more pretrain_gpt.py flags]
#   env: WD (weight decay, 0.1), CLIP (1.0), EP (2), EXPERTS (4)
set -eu
MEGATRON=$1; DATA=$2; OUT=$3; STAGE=$4; HECATE=$5; shift 5
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
SECTION=""
if [ "$HECATE" = 1 ]; then SECTION=', "hecate": {"enabled": true}'; fi
cat > "$OUT/ds.json" <<JSON
{"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
 "zero_optimization": {"stage": $STAGE$SECTION}, "gradient_clipping": ${CLIP:-1.0}, "prescale_gradients": false,
 "fp16": {"enabled": false}, "bf16": {"enabled": false}, "wall_clock_breakdown": false}
JSON
PORT=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
# DeepSpeed's CPU all-reduce leaves a shared-memory file per rank and port behind; a later run on the same port
# would attach to it
trap 'rm -f /dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_${PORT}_*' EXIT
cd "$MEGATRON"
export PYTHONPATH="$HERE/stubs${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR=cpu LOCAL_SIZE=2 OMP_NUM_THREADS=1 \
       CUDA_DEVICE_MAX_CONNECTIONS=1
python -m deepspeed.launcher.runner --num_gpus 2 --master_port "$PORT" pretrain_gpt.py \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 1 --global-batch-size 2 --train-iters 20 \
  --num-experts "${EXPERTS:-4}" --moe-expert-parallel-size "${EP:-2}" --moe-loss-coeff 0.01 \
  --moe-train-capacity-factor 1.0 --moe-eval-capacity-factor 1.0 --moe-min-capacity 4 --create-moe-param-group \
  --override-opt_param-scheduler --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.014 \
  --lr 4.5e-3 --min-lr 4.5e-5 --lr-decay-style cosine --lr-warmup-tokens 640 --lr-decay-tokens 2560 \
  --weight-decay "${WD:-0.1}" --clip-grad "${CLIP:-1.0}" --hysteresis 2 --num-workers 0 --split 98,2,0 \
  --log-interval 1 --eval-interval 1000 --eval-iters 1 --save-interval 100000 --seed 1234 \
  --attention-dropout 0 --hidden-dropout 0 \
  --tokenizer-type NullTokenizer --vocab-size 500 --data-path "$DATA" --data-impl mmap \
  --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-gradient-accumulation-fusion \
  --checkpoint-activations --deepspeed-activation-checkpointing \
  --deepspeed --deepspeed_config "$OUT/ds.json" --zero-stage "$STAGE" --pipeline-model-parallel-size 1 \
  --no-pipeline-parallel --tensor-model-parallel-size 1 "$@" 2>&1 | tee "$OUT/log.txt" \
  | grep -E " iteration .*lm loss|ds_hecate\]|Error" || true
