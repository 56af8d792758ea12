"""The zoo's tokenizer and chat template: a byte-level BPE (GPT-2's byte alphabet, as Qwen's,
GPT-OSS's and DeepSeek's vocabularies are) of any size, made from nothing but its size, and a
ChatML template that renders tools. llama.cpp tokenizes with it like any real vocabulary, so
prompts cost what they would: English text takes about 3 characters a token."""

from __future__ import annotations

import functools
from dataclasses import dataclass

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NORMAL, CONTROL = 1, 3  # llama.cpp's token types


@dataclass(frozen=True, slots=True)
class Vocabulary:
    tokens: list[str]
    types: list[int]
    merges: list[str]

    @property
    def eos(self) -> int:
        return self.tokens.index("<|im_end|>")

    @property
    def bos(self) -> int:
        return self.tokens.index("<|endoftext|>")


@functools.cache
def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def vocabulary(size: int) -> Vocabulary:
    """`size` tokens: the 256 bytes, merges of text characters (a space and the printable ASCII
    ones) level by level (every pair, then every pair extended by one character, ...), and the
    ChatML specials last. Deterministic: the same size gives the same vocabulary."""
    if size < 256 + len(SPECIALS) + 1:
        raise ValueError(
            f"a vocabulary needs at least {256 + len(SPECIALS) + 1} tokens, not {size}"
        )
    alphabet = _byte_alphabet()
    letters = [alphabet[b] for b in range(32, 127)]  # the space (as Ġ) and printable ASCII
    tokens, merges = list(alphabet), []
    want = size - len(SPECIALS)
    level = letters
    while len(tokens) < want:
        grown = []
        for left in level:
            for right in letters:
                grown.append(left + right)
                merges.append(f"{left} {right}")
                tokens.append(left + right)
                if len(tokens) == want:
                    break
            if len(tokens) == want:
                break
        level = grown
    types = [NORMAL] * len(tokens) + [CONTROL] * len(SPECIALS)
    return Vocabulary([*tokens, *SPECIALS], types, merges)


# ChatML, with tools as Qwen's templates render them (a tool list in the system turn, calls in
# <tool_call> tags), so that a server reads its tool calls back.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within "
    "<tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object within <tool_call></tool_call>:"
    '\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] %}{%- for call in message['tool_calls'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- call['function']['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
