"""The training engine inside each rank: the DeepSpeed config (`ds_config`), the trainer
(`trainer`), checkpoints and resume (`checkpoint`), export (`export`), the shared host gradient
slot (`grad_buffer`), graceful stop (`stop`), DeepSpeed op build diagnostics (`opbuild`) and the
rank entry point (`worker`)."""
