"""Tests of the data pipeline and the prompt contract (no torch needed).

    python -m pytest training/test_data.py -q
"""

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training"))

import data  # noqa: E402
import prompts  # noqa: E402

MODEL = ROOT / "engine" / "reference_model"
CODE = "def foo(x):\n    foobar = foo(x)  # foo\n    return self.foo + foobar\n" * 20
UNIQ = "".join(f"def foo_{i}(x):\n    foobar = foo(x, {i})  # step {i}\n    return self.foo + foobar\n" for i in range(20))


def test_prompts_contract():
    assert {"system", "rename_symbol", "edit_file", "rewrite_file", "continue_file"} <= set(prompts.names())
    u = prompts.render("rename_symbol", path="a.py", old="a", new="b", code="x = {1: 2}\n")
    assert "x = {1: 2}\n```" in u
    assert prompts.extract_code(prompts.fence("x = 1\n")) == "x = 1\n"
    assert prompts.extract_code("hi\n```python\na\n```\nbye\n```py\nb\n```") == "a\n"
    assert prompts.extract_code("```python\nunfinished") is None
    assert prompts.extract_code("no code") is None


def test_rename_word_boundaries():
    out = data.rename(CODE, "foo", "bar")
    assert "bar(x)" in out and "foobar" in out and "self.bar" in out and "# bar" in out


def test_stdlib_excluded():
    std = data.stdlib_dirs()
    assert data.is_stdlib_path("/usr/lib/python3.12/json/__init__.py", std)
    assert not data.is_stdlib_path("/usr/lib/python3/dist-packages/yaml/__init__.py", std)
    assert not data.is_stdlib_path("/opt/x/lib/python3.12/site-packages/numpy/core.py", std)


@pytest.mark.parametrize("kind", ["rename", "edit", "rewrite", "continue"])
def test_tasks(kind):
    rng = random.Random(0)
    s = None
    for _ in range(50):
        s = data.make_task(kind, "pkg/mod.py", UNIQ, rng, 40, 60)
        if s:
            break
    assert s is not None
    assert s.prompt.endswith("<|im_start|>assistant\n")
    assert s.answer.startswith("```python\n") and s.answer.endswith("```<|im_end|>")
    assert prompts.extract_code(s.answer) is not None


@pytest.mark.skipif(not (MODEL / "tokenizer_config.json").exists(), reason="no exported model")
def test_training_prefix_matches_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL))
    sysm = prompts.load("system").rstrip("\n")
    user = prompts.render("rename_symbol", path="a.py", old="foo", new="bar", code=CODE)
    msgs = [{"role": "system", "content": sysm}, {"role": "user", "content": user}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == data.chat_prefix(user, sysm)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    msgs += [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
             {"role": "tool", "content": "ok"}]
    s = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>' in s
    assert "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>" in s
