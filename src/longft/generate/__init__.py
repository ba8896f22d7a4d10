"""`longft generate`: what the finetune learned. Loads the exported model (export/: a full model, a
merged one, or a LoRA adapter on its base) with its tokenizer (`loading`), builds prompts with the
chat template from given text or from held-out records of data/prepared (`prompts`), and samples
(greedy by default) on the GPU or the CPU (`command`)."""

from longft.generate.loading import ExportMissingError, load_export
from longft.generate.prompts import Prompt, chat_prompt, held_out_prompts

__all__ = ["ExportMissingError", "Prompt", "chat_prompt", "held_out_prompts", "load_export"]
