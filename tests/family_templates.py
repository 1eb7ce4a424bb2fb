"""Small chat templates in the shape of each family's own (how they render tools, tool calls,
tool results and the generation prompt), for the tiny test tokenizer: enough for the server
to recognise the syntax and to render a conversation as the family's template would."""

_TOOLS = "{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{%- endif %}"
_ARG = "{{ v if v is string else v | tojson }}"

QWEN3_CODER = _TOOLS + (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}\n<tool_call>\n<function={{ tc.function.name }}>\n"
    "{%- for k, v in tc.function.arguments.items() %}<parameter={{ k }}>\n" + _ARG + "\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

GLM47 = _TOOLS + (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>"
    "{%- elif m.role == 'assistant' %}<|assistant|>"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{%- else %}</think>{%- endif %}"
    "{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
    "{%- for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>" + _ARG
    + "</arg_value>{% endfor %}</tool_call>{%- endfor %}"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|><think>{% endif %}"
)

KIMI_K2 = _TOOLS + (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}"
    "{%- if m.tool_calls %}<|tool_calls_section_begin|>{%- for tc in m.tool_calls %}<|tool_call_begin|>"
    "functions.{{ tc.function.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>{{ tc.function.arguments | tojson }}"
    "<|tool_call_end|>{%- endfor %}<|tool_calls_section_end|>{%- endif %}<|im_end|>"
    "{%- else %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)

MISTRAL = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- elif m.role == 'assistant' %}{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}"
    "{%- endfor %}<|im_end|>"
    "{%- else %}[INST]{{ m.content }}[/INST]{%- endif %}{%- endfor %}"
)

HARMONY = (
    "{%- if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start|>functions.x to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }}"
    " <|constrain|>json<|message|>{{ tc.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- if not m.tool_calls %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)

TEMPLATES = {"qwen3_coder": QWEN3_CODER, "glm47": GLM47, "kimi_k2": KIMI_K2, "mistral": MISTRAL,
             "harmony": HARMONY}
