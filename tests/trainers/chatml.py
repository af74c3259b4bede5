"""A ChatML tokenizer built locally with the ``tokenizers`` library (no hub download).

Byte-level BPE trained on a few sentences, with Qwen's special tokens and a ChatML chat
template, wrapped as a transformers ``PreTrainedTokenizerFast``: what verl and TRL expect.
"""

from __future__ import annotations

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are a helpful agent. Find the flights and book the cheapest one.",
    "search(origin='SFO', destination='JFK') returned 3 results: UA 12, DL 7, AA 100.",
    "The user asked to cancel the reservation; the tool answered with an error.",
    "def solve(x):\n    return sorted(set(x))\n",
]


def chatml_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 4, vocab_size=320, min_frequency=2,
                            special_tokens=SPECIAL, show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", bos_token=None)
    tok.chat_template = CHATML
    return tok
