"""Build configs/tokenizers/byte: a byte-level tokenizer (256 byte tokens + Llama-3-style specials,
with a chat template) that needs no download. Used by random-init models and the tests.

Run: python configs/tokenizers/build_byte.py
"""
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def main(out: Path = Path(__file__).parent / "byte") -> None:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[2])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


if __name__ == "__main__":
    main()
