"""Builds small Hugging Face tokenizer directories in-process, for the tokenization tests: nothing is
downloaded. A byte-level BPE is trained with the ``tokenizers`` library on a fixed corpus (so every text
encodes, and the ids are deterministic), saved as ``tokenizer.json``, and a ``tokenizer_config.json`` gives
the special tokens and a ChatML (Qwen2.5/Qwen3-like) chat template with tools, tool calls, reasoning,
``add_generation_prompt`` and ``enable_thinking``.

Two templates: :data:`CHATML_TEMPLATE` takes string content (vLLM detects the "string" content format) and
never names the ``developer`` role (vLLM converts it to system); :data:`PARTS_TEMPLATE` loops over content
parts (the "openai" format) and renders developer turns itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS = "<|endoftext|>"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "You are a helpful assistant. What is the weather in Paris today? It is sunny and warm.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {}}}',
    "Prefix caching lets vLLM reuse KV blocks across requests that share a prompt prefix.",
    "Routers place each request on the node that already holds the longest cached prefix.",
    "Ünïcödé tëxt, emojis 🙂🚀 and 中文字符 also appear in real prompts.",
    "<tool_call>\n</tool_call>\n<tool_response>\n</tool_response>\n<think>\n</think>\n",
] * 20

_TOOLS_HEADER = (
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}\n"
    "{{- \"\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>\" }}\n"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}\n"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call>"
    " XML tags.<|im_end|>\\n\" }}\n"
)

CHATML_TEMPLATE = (
    "{%- if tools %}\n" + _TOOLS_HEADER + "{%- else %}\n"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}\n"
    "{{- message.content }}\n"
    "{%- for tool_call in message.tool_calls or [] %}\n"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}\n"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}"
    "{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}\n"
    "{%- endif %}\n"
)

PARTS_TEMPLATE = (
    "{%- macro render(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- else %}{%- for part in content %}{%- if part.type == 'text' %}{{- part.text }}{%- endif %}"
    "{%- if not loop.last %}{{- ' | ' }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- endmacro %}\n"
    "{%- if tools %}{{- '<|im_start|>tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'developer' %}{{- '<|im_start|>developer\\n' + render(message.content) }}"
    "{%- if message.tools is not none %}{{- ' tools=' + (message.tools | tojson) }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{{- render(message.content) }}"
    "{%- for tc in message.tool_calls %}{{- '\\n' + (tc | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

BOS_TEMPLATE = "{{- bos_token }}\n" + CHATML_TEMPLATE


def build_tokenizer(
    out_dir: str | Path,
    *,
    template: str | None = CHATML_TEMPLATE,
    bos: bool = False,
    vocab_size: int = 800,
    config_extra: dict[str, Any] | None = None,
) -> Path:
    """Train a byte-level BPE and write a transformers-loadable directory to ``out_dir``.

    ``bos=True`` gives a Llama-style post-processor (``add_special_tokens=True`` prepends BOS) and sets
    ``bos_token``; ``template=None`` writes no chat template.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))  # byte-level: no <unk> needed
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # the generic class: tokenizer.json as it is
        "bos_token": BOS if bos else None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
    }
    if template is not None:
        config["chat_template"] = template
    config.update(config_extra or {})
    text = json.dumps(config, indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return out
