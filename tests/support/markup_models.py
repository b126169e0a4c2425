"""Demo models that speak another family's tool-call markup.

A copy of a built demo model whose chat template writes tool calls the way
Qwen3-Coder, GLM or Gemma 4 templates do (small templates written here, in
ChatML framing, so the demo vocabulary's turn tokens still apply). For
Gemma 4 the copy's tokenizer also renames three control tokens to Gemma 4's
``<|tool_call>``, ``<tool_call|>`` and ``<|"|>``: same ids, so the weights
still fit, and the markup's tokens are single tokens as in Gemma 4's own
vocabulary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Final

_TOOLS_BLOCK: Final = (
    "{%- if tools -%}<|im_start|>system\nTools:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Call one like this: {MARKUP}<|im_end|>\n{%- endif -%}\n"
)
_TURNS: Final = (
    "{%- for m in messages -%}\n"
    "{%- if m.role == 'tool' -%}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response>"
    "<|im_end|>\n"
    "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content or '' }}\n"
    "{%- for tc in m.tool_calls or [] -%}{CALL}{%- endfor -%}<|im_end|>\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)

_QWEN3_CODER_CALL: Final = (
    "{{- '<tool_call>\\n<function=' + tc.function.name + '>\\n' -}}"
    "{%- for k, v in tc.function.arguments.items() -%}"
    "{{- '<parameter=' + k + '>\\n' -}}"
    "{{- v if v is string else v | tojson -}}"
    "{{- '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' -}}"
)
_GLM_CALL: Final = (
    "{{- '<tool_call>' + tc.function.name + '\\n' -}}"
    "{%- for k, v in tc.function.arguments.items() -%}"
    "{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' -}}"
    "{{- v if v is string else v | tojson -}}"
    "{{- '</arg_value>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</tool_call>' -}}"
)
_GEMMA_VALUE: Final = (
    "{%- macro gemma_value(v) -%}"
    "{%- if v is string -%}{{- '<|\"|>' + v + '<|\"|>' -}}"
    "{%- elif v is boolean -%}{{- 'true' if v else 'false' -}}"
    "{%- elif v is none -%}{{- 'null' -}}"
    "{%- elif v is mapping -%}{{- '{' -}}"
    "{%- for k, x in v | dictsort -%}{%- if not loop.first -%},{%- endif -%}"
    "{{- k + ':' -}}{{- gemma_value(x) -}}{%- endfor -%}{{- '}' -}}"
    "{%- elif v is iterable -%}{{- '[' -}}"
    "{%- for x in v -%}{%- if not loop.first -%},{%- endif -%}{{- gemma_value(x) -}}"
    "{%- endfor -%}{{- ']' -}}"
    "{%- else -%}{{- v -}}{%- endif -%}"
    "{%- endmacro -%}\n"
)
_GEMMA_CALL: Final = (
    "{{- '<|tool_call>call:' + tc.function.name -}}"
    "{{- gemma_value(tc.function.arguments) -}}"
    "{{- '<tool_call|>' -}}"
)

TEMPLATES: Final = {
    "qwen3_coder": _TOOLS_BLOCK.replace(
        "{MARKUP}",
        "<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n"
        "</function>\n</tool_call>",
    )
    + _TURNS.replace("{CALL}", _QWEN3_CODER_CALL),
    "glm": _TOOLS_BLOCK.replace(
        "{MARKUP}",
        "<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>",
    )
    + _TURNS.replace("{CALL}", _GLM_CALL),
    "gemma4": _GEMMA_VALUE
    + _TOOLS_BLOCK.replace("{MARKUP}", '<|tool_call>call:NAME{key:<|"|>value<|"|>}<tool_call|>')
    + _TURNS.replace("{CALL}", _GEMMA_CALL),
}

# Gemma 4's markup tokens, on ids the demo vocabulary gives control tokens.
GEMMA_TOKENS: Final = {
    "<tool_call>": "<|tool_call>",
    "</tool_call>": "<tool_call|>",
    "<tool_response>": '<|"|>',
}


def markup_model(base: Path, family: str, dest: Path) -> Path:
    """A copy of the demo model ``base`` in ``dest`` whose template (and for
    ``gemma4`` tokenizer) speaks ``family``'s tool-call markup."""
    if dest.exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    config_path = tmp / "tokenizer_config.json"
    config = json.loads(config_path.read_text("utf-8"))
    config["chat_template"] = TEMPLATES[family]
    if family == "gemma4":
        tok_path = tmp / "tokenizer.json"
        tok = json.loads(tok_path.read_text("utf-8"))
        for added in tok["added_tokens"]:
            added["content"] = GEMMA_TOKENS.get(added["content"], added["content"])
        vocab = tok["model"]["vocab"]
        for old, new in GEMMA_TOKENS.items():
            vocab[new] = vocab.pop(old)
        tok_path.write_text(json.dumps(tok, ensure_ascii=False), "utf-8")
        for entry in (config.get("added_tokens_decoder") or {}).values():
            entry["content"] = GEMMA_TOKENS.get(entry["content"], entry["content"])
    config_path.write_text(json.dumps(config, ensure_ascii=False), "utf-8")
    tmp.rename(dest)
    return dest
