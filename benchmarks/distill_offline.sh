#!/bin/bash
# Offline distillation targets against the online teacher and plain LM fine-tuning (issue 33): the same
# 20 steps of 4 x 256 tokens on one MLA model; prints each command's wall time and peak RSS, the last
# loss line of each run and its WikiText-2 perplexity (8 x 1024). Measures and prints; asserts nothing.
#
#   benchmarks/distill_offline.sh MLA_DIR SCRATCH_DIR [TEACHER]     (TEACHER: default smollm2-135m)
set -eu
MLA=$1 S=$2 TEACHER=${3:-smollm2-135m}
RUN="--steps 20 --seq-len 256 --batch-size 4"
rm -rf "$S/targets" "$S/.targets.partial" "$S/online" "$S/offline" "$S/plain"
mkdir -p "$S"
timed() { local name=$1; shift; /usr/bin/time -f "$name: %e s, peak RSS %M KB" "$@"; }
timed distill-targets .venv/bin/mha2mla distill-targets "$TEACHER" "$S/targets" $RUN --top-k 64 --json
du -sb "$S/targets"
timed "train online" .venv/bin/mha2mla train "$MLA" "$S/online" $RUN --distill --teacher "$TEACHER" --save-every 0 --json
timed "train offline" .venv/bin/mha2mla train "$MLA" "$S/offline" $RUN --distill --distill-targets "$S/targets" --save-every 0 --json
timed "train plain" .venv/bin/mha2mla train "$MLA" "$S/plain" $RUN --save-every 0 --json
for r in online offline plain; do
  echo "$r: $(tail -n 1 "$S/$r/loss.jsonl")"
  echo "$r: $(.venv/bin/mha2mla eval ppl "$S/$r" --seq-len 1024 --windows 8 --json 2>/dev/null | tail -n 1)"
done
