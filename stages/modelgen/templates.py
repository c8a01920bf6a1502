"""Chat templates (Jinja, as Hugging Face tokenizers carry them).

Message content is a string or a list of parts: `{"type": "text", "text": ...}`, `{"type": "image"}` or
`{"type": "image_url", ...}` (an image). Images render as the family's placeholder, which the processor
(or the serving prompt builder) then expands to one token per image embedding. Every literal is written
as a Jinja expression and every tag strips whitespace, so the layout of the template source never leaks
into the prompt.
"""

_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') or 'image' in part or 'image_url' in part -%}"
    "{{- '@IMAGE@' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
)

# ChatML as in Qwen2-VL-Instruct: an optional default system turn, each turn closed by <|im_end|>\n.
_CHATML = (
    "{%- for message in messages -%}"
    "{%- if @DEFAULT_SYSTEM@ and loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT + "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# LLaVA-1.5 style: "<s>USER: <image>\nWhat is this?\nASSISTANT: answer</s>\n..."
_LLAVA = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- 'USER: ' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'ASSISTANT: ' -}}{%- endif -%}"
    + _CONTENT
    + "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
LLAVA_IMAGE = "<image>\\n"


def chatml(image_placeholder: str, default_system: bool = True) -> str:
    """ChatML; `image_placeholder` is Jinja-string-literal text (escape newlines as a backslash-n)."""
    flag = "true" if default_system else "false"
    return _CHATML.replace("@IMAGE@", image_placeholder).replace("@DEFAULT_SYSTEM@", flag)


def llava(image_placeholder: str = LLAVA_IMAGE) -> str:
    return _LLAVA.replace("@IMAGE@", image_placeholder)
