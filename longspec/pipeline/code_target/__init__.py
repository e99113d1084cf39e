"""The project's own small Llama code target: pretrained on the stdlib corpus, shipped as
longspec/assets/code_target, the target the `cpu` pipeline preset drafts for.

    python -m longspec.pipeline.code_target --corpus DIR --tokenizer TOKDIR --tokens-dir DIR/tokens --out CKPT
    bash launch/pretrain_target.sh [OUT_DIR]      # corpus + tokenizer + pretraining + evaluation

- presets: `MODEL_PRESETS` / `TRAIN_PRESETS` (smoke / tiny / gpu100m), `PretrainConfig`, `build_model_config`
- data: the tokenizer, the uint16 token cache and `PackedStream` (packed training windows)
- evaluate: held-out loss / top-1, greedy continuations, `eval_checkpoint`
- trainer: `train()` (the loop) and `save_checkpoint()`
- __main__: the CLI
"""
