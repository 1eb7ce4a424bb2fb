"""Replies written by hand in each model family's tool-call syntax, from the formats' public
documentation and model cards (Hermes/Qwen2.5-3 function calling, Qwen3-Coder's
qwen3coder_tool_parser.py, GLM-4.5/4.7 chat templates, Kimi K2 docs/tool_call_guidance.md,
Mistral's tokenizer v11 `[TOOL_CALLS]name[ARGS]{...}`, OpenAI's harmony format for gpt-oss).

Each: (syntax, reply text, expected blocks). Blocks are ("text"|"reasoning", str) or
("call", name, arguments)."""

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "set_flags", "parameters": {
        "type": "object", "properties": {
            "count": {"type": "integer"}, "ratio": {"type": "number"}, "force": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "object"}}}}},
]

CODE = 'def f(x):\n    return "<tool_call>" + x  # a \\ backslash\n'

HERMES = (
    "<think>\nThe user wants a.py.\n</think>\n\nLet me read it.\n"
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "set_flags", "arguments": {"count": 3, "ratio": 0.5, "force": true, '
    '"tags": ["x", "y\\"z"], "opts": {"a": null, "b": [1, -2.5e3]}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "b.py", "content": '
    + __import__("json").dumps(CODE) + "}}\n</tool_call>"
)

QWEN_XML = (
    "<think>\nplan\n</think>\n\nI'll write it.\n"
    "<tool_call>\n<function=write_file>\n<parameter=path>\nb.py\n</parameter>\n"
    "<parameter=content>\n" + CODE + "\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=set_flags>\n<parameter=count>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
    "<parameter=force>\ntrue\n</parameter>\n<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n"
    "<parameter=opts>\n{\"a\": 1}\n</parameter>\n</function>\n</tool_call>"
)

GLM = (
    "<think>check the file</think>Sure.\n"
    "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n</tool_call>\n"
    "<tool_call>set_flags<arg_key>count</arg_key><arg_value>3</arg_value><arg_key>force</arg_key>"
    "<arg_value>false</arg_value><arg_key>opts</arg_key><arg_value>{\"a\": 1}</arg_value></tool_call>"
    "<tool_call>write_file<arg_key>path</arg_key><arg_value>b.py</arg_value><arg_key>content</arg_key>"
    "<arg_value>" + CODE + "</arg_value></tool_call>"
)

KIMI = (
    "<think>read then write</think>Reading.<|tool_calls_section_begin|>"
    "<|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{\"path\": \"a.py\"}<|tool_call_end|>"
    "<|tool_call_begin|>functions.write_file:1<|tool_call_argument_begin|>{\"path\": \"b.py\", \"content\": "
    + __import__("json").dumps(CODE) + "}<|tool_call_end|><|tool_calls_section_end|>"
)

MISTRAL = (
    "Sure.[TOOL_CALLS]read_file[ARGS]{\"path\": \"a.py\"}"
    "[TOOL_CALLS]write_file[ARGS]{\"path\": \"b.py\", \"content\": " + __import__("json").dumps(CODE) + "}"
)

MISTRAL_ARRAY = '[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a.py"}}, {"name": "set_flags", "arguments": {"count": 3}}]'

HARMONY = (
    "<|channel|>analysis<|message|>Need to read the file first.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Reading a.py.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{\"path\":\"a.py\"}<|call|>"
)

HARMONY_FINAL = (
    "<|channel|>analysis<|message|>It is done.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>All good: see `<|x|>` docs.<|return|>"
)

HARMONY_INTERLEAVED = (
    "<|channel|>analysis<|message|>First the file.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{\"path\":\"a.py\"}<|call|>"
    "<|start|>assistant<|channel|>analysis<|message|>Then the flags.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.set_flags <|constrain|>json<|message|>{\"count\":2}<|call|>"
)

HERMES_INTERLEAVED = (
    "<think>a first</think>"
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    "<think>then b</think>Now b.\n"
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "b.py"}}\n</tool_call>'
)

CASES = {
    "hermes": ("hermes", HERMES, [
        ("reasoning", "\nThe user wants a.py.\n"), ("text", "Let me read it."),
        ("call", "read_file", {"path": "a.py"}),
        ("call", "set_flags", {"count": 3, "ratio": 0.5, "force": True, "tags": ["x", 'y"z'],
                               "opts": {"a": None, "b": [1, -2500.0]}}),
        ("call", "write_file", {"path": "b.py", "content": CODE})]),
    "qwen3_coder": ("qwen3_coder", QWEN_XML, [
        ("reasoning", "\nplan\n"), ("text", "I'll write it."),
        ("call", "write_file", {"path": "b.py", "content": CODE}),
        ("call", "set_flags", {"count": 3, "ratio": 0.5, "force": True, "tags": ["x", "y"], "opts": {"a": 1}})]),
    "glm47": ("glm47", GLM, [
        ("reasoning", "check the file"), ("text", "Sure."),
        ("call", "read_file", {"path": "a.py"}),
        ("call", "set_flags", {"count": 3, "force": False, "opts": {"a": 1}}),
        ("call", "write_file", {"path": "b.py", "content": CODE.strip()})]),
    "kimi_k2": ("kimi_k2", KIMI, [
        ("reasoning", "read then write"), ("text", "Reading."),
        ("call", "read_file", {"path": "a.py"}), ("call", "write_file", {"path": "b.py", "content": CODE})]),
    "mistral": ("mistral", MISTRAL, [
        ("text", "Sure."), ("call", "read_file", {"path": "a.py"}),
        ("call", "write_file", {"path": "b.py", "content": CODE})]),
    "mistral_array": ("mistral", MISTRAL_ARRAY, [
        ("call", "read_file", {"path": "a.py"}), ("call", "set_flags", {"count": 3})]),
    "harmony": ("harmony", HARMONY, [
        ("reasoning", "Need to read the file first."), ("text", "Reading a.py."),
        ("call", "read_file", {"path": "a.py"})]),
    "harmony_interleaved": ("harmony", HARMONY_INTERLEAVED, [
        ("reasoning", "First the file."), ("call", "read_file", {"path": "a.py"}),
        ("reasoning", "Then the flags."), ("call", "set_flags", {"count": 2})]),
    "hermes_interleaved": ("hermes", HERMES_INTERLEAVED, [
        ("reasoning", "a first"), ("call", "read_file", {"path": "a.py"}),
        ("reasoning", "then b"), ("text", "Now b."), ("call", "read_file", {"path": "b.py"})]),
    "harmony_final": ("harmony", HARMONY_FINAL, [
        ("reasoning", "It is done."), ("text", "All good: see `<|x|>` docs.")]),
}

# The part of each syntax that must never reach a client as text.
MARKUP = ["<tool_call", "</tool_call", "<function=", "<parameter=", "<arg_key", "<arg_value", "<think", "</think",
          "<|tool_call", "[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>"]
