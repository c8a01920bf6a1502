"""Chat templates (Jinja, as Hugging Face tokenizers carry them).

Message content is a string or a list of parts: `{"type": "text", "text": ...}`, `{"type": "image"}` or
`{"type": "image_url", ...}` (an image), `{"type": "video"}` or `{"type": "video_url", ...}` (a video; the
Qwen families write `<|vision_start|><|video_pad|><|vision_end|>` as their hub templates do, LLaVA nothing).
Images and videos render as the family's placeholder, which the processor
(or the serving prompt builder) then expands to one token per image embedding. Every literal is written
as a Jinja expression and every tag strips whitespace, so the layout of the template source never leaks
into the prompt.
"""

_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') or 'image' in part or 'image_url' in part -%}"
    "{{- '@IMAGE@' -}}"
    "{%- elif part['type'] in ('video', 'video_url') or 'video' in part or 'video_url' in part -%}"
    "{{- '@VIDEO@' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
)

# ChatML as in Qwen2-VL-Instruct: an optional default system turn, each turn closed by <|im_end|>\n;
# with tools, Qwen2.5's tool format (as Qwen2.5-VL-Instruct's tokenizer template writes it): the system
# turn (the conversation's own, else the default text, else none) followed by a "# Tools" block listing
# each tool as JSON in <tools></tools>; an assistant's tool calls each as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> after its text; consecutive tool results
# as one user turn of <tool_response>\n...\n</tool_response> blocks.
_TOOLS_INTRO = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n"
)
_CHATML = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set message = messages[0] -%}" + _CONTENT + "{{- '\\n\\n' -}}"
    "{%- elif @DEFAULT_SYSTEM@ -%}{{- 'You are a helpful assistant.\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '" + _TOOLS_INTRO + "' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '" + _TOOLS_OUTRO + "' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}" + _CONTENT + "{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message['content'] -%}{{- '\\n' -}}" + _CONTENT + "{%- endif -%}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- if tool_call['function'] is defined -%}{%- set tool_call = tool_call['function'] -%}{%- endif -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' -}}"
    "{{- tool_call['arguments'] | tojson -}}{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{%- if @DEFAULT_SYSTEM@ and not tools and loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT + "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
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
QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
LLAVA_IMAGE = "<image>\\n"


def chatml(image_placeholder: str, default_system: bool = True, video_placeholder: str = "") -> str:
    """ChatML; the placeholders are Jinja-string-literal text (escape newlines as a backslash-n)."""
    flag = "true" if default_system else "false"
    return (_CHATML.replace("@IMAGE@", image_placeholder).replace("@VIDEO@", video_placeholder)
            .replace("@DEFAULT_SYSTEM@", flag))


def llava(image_placeholder: str = LLAVA_IMAGE) -> str:
    return _LLAVA.replace("@IMAGE@", image_placeholder).replace("@VIDEO@", "")
