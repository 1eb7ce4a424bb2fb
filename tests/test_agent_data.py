"""The agent-format training data (training/agent_data.py) is the text the server feeds the model.

The real Claude Code CLI renames two files against capture_sessions.py's recording server (the
CLI runs offline); the captured requests are rendered through the server's own request parsing
and chat template, and the sessions the training builder makes from the resulting frame must equal
that rendering for every request (frame_from_session raises where they differ). Then random
sessions from that frame: the trained spans are the model's three turns and nothing else.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import agent_data  # noqa: E402
import data  # noqa: E402

CLAUDE = ROOT / ".node" / "node_modules" / ".bin" / "claude"
MODEL = ROOT / "engine" / "reference_model"


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    if not CLAUDE.exists():
        pytest.skip(f"{CLAUDE} is absent: run scripts/setup.sh")
    out = tmp_path_factory.mktemp("captures")
    files = [str(ROOT / "engine" / "drafting" / "lookup.py"), str(ROOT / "engine" / "base" / "events.py")]
    p = subprocess.run([sys.executable, str(ROOT / "training" / "capture_sessions.py"), "--out", str(out),
                        "--files", *files], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("renamed on disk: True") == 2, p.stdout  # the CLI ran Read and Write
    logs = sorted(out.glob("session-*.jsonl"))
    assert [len(f.read_text().splitlines()) for f in logs] == [3, 3]
    return agent_data.build_frames(out, MODEL)  # checks every request's rendering


def test_frames_hold_fields_not_this_run(frames):
    assert len(frames) == 1  # both sessions: the same CLI, the same prompt but for the fields
    prompt = frames[0].prompt
    for name in agent_data.FIELDS:
        assert agent_data.field(name) in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert agent_data.field("PATH") in frames[0].write_result


def test_sessions_train_the_three_turns_only(frames):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    text = (ROOT / "engine" / "caches" / "radix_tree.py").read_text()
    rng = random.Random(5)
    forms = set()
    for _ in range(40):
        session = agent_data.make_session(frames, "pkg/radix_tree.py", text, rng)
        if session is None:
            continue
        segments, focus = session
        trained = [s for s, t in segments if t]
        forms.add(trained[-1].startswith("<tool_call>"))
        assert trained[0].startswith('<tool_call>\n{"name": "Read", "arguments": {"file_path": "/')
        cwd = segments[0][0].split("Primary working directory: ", 1)[1].split("\n", 1)[0]
        assert json.loads(trained[0].split("\n")[1][len('{"name": "Read", "arguments": '):-1])["file_path"].startswith(cwd + "/")
        ids, mask = agent_data.encode_segments(tok, segments)
        learned = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
        assert learned == "".join(trained)
        _, weights = agent_data.encode_segments(tok, segments, focus, focus_weight=5)
        assert [bool(w) for w in weights] == [bool(m) for m in mask] and set(weights) == {0, 1, 5}
        path = json.loads(trained[0].split("\n")[1][len('{"name": "Read", "arguments": '):-1])["file_path"]
        assert path in tok.decode([i for i, w in zip(ids, weights) if w == 5])  # the path it must copy
        if trained[-1].startswith('<tool_call>\n{"name": "Write"'):
            call = json.loads(trained[-1][len("<tool_call>\n"):-len("\n</tool_call><|im_end|>")])
            before = segments[2][0].split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0]
            original = "\n".join(line.split("\t", 1)[1] for line in before.split("\n"))
            assert call["arguments"]["content"] != original
            assert len(call["arguments"]["content"].splitlines()) >= len(original.splitlines()) - 1
    assert forms == {True, False}  # both the Write form and the closing form occur


def test_a_working_directory_must_be_copied():
    rng = random.Random(0)
    cwds = {agent_data.random_cwd(rng, "utils")[0] for _ in range(200)}
    assert len(cwds) > 190
    assert any(c.rstrip("/").endswith("utils") or "_utils" in c or "utils_" in c or "utils-" in c for c in cwds)


def test_focus_weights_fall_on_the_rename_sites():
    """A chat-format rename: the reply's tokens touching the new name weigh `focus_weight`, the
    rest of the reply 1, the prompt 0."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    rb = data.RowBuilder(tok, [("pkg/radix_tree.py", (ROOT / "engine" / "caches" / "radix_tree.py").read_text())], [],
                         seq_len=8192, seed=3, focus_weight=4)
    sample = None
    while sample is None:
        sample = data.make_task("rename", "pkg/radix_tree.py", rb.code[0][1], rb.rng)
    text = sample.prompt + sample.answer
    enc = tok.encode(text)
    sites = data.focus_spans(text, sample.focus)
    weights = data.loss_weights(enc.offsets, [(len(sample.prompt), len(text))], sites, 4)
    assert sites
    for (start, end), w in zip(enc.offsets, weights):
        if start < len(sample.prompt):
            assert w == 0
        else:
            touches = any(a < end and start < b for a, b in sites)
            assert w == (4 if touches else 1), (text[start:end], w)
    answer_sites = [(a, b) for a, b in sites if a >= len(sample.prompt)]
    for m in re.finditer(sample.focus[0], sample.answer):  # every new name lies in a site
        start = len(sample.prompt) + m.start()
        assert any(a < start and start + len(m.group(0)) < b for a, b in answer_sites)


def test_focus_covers_the_old_name_left_inside_longer_names():
    """Renaming `size` leaves `size_diff` and `resize` alone: those places weigh as much as the new
    name's, since a small model renames them by mistake."""
    before = "size = 1\nsize_diff = size - 2\ndef resize(size):\n    return size_diff + size\n"
    after = data.rename(before, "size", "count")
    assert after == "count = 1\nsize_diff = count - 2\ndef resize(count):\n    return size_diff + count\n"
    focus = data.rename_focus([("size", "count")])
    sites = [after[a:b] for a, b in data.focus_spans(after, focus)]
    assert sites == ["count ", "\nsize_", " count ", "esize(count)", " size_", " count\n"]


def test_a_rewrite_focuses_on_its_renames_only():
    """A rewrite's focus is its renames, one or two (`rename_focus`), never a line edit's text."""
    text = (ROOT / "engine" / "caches" / "radix_tree.py").read_text()
    rng, seen = random.Random(7), set()
    while len(seen) < 2:
        sample = data.make_task("rewrite", "pkg/radix_tree.py", text, rng)
        if sample is None:
            continue
        instruction = re.search(r"Rename `.*", sample.prompt).group(0)
        renames = re.findall(r"`([A-Za-z_]\w*)` to `([A-Za-z_]\w*)`", instruction)
        seen.add(len(renames))
        assert sample.focus == data.rename_focus(renames)
        assert all(len(data.focus_spans(sample.answer, [data.name_pattern(new)])) >= 1 for _, new in renames)


def test_focus_covers_whole_words_inside_the_old_name():
    """Renaming `weights` leaves the string's `weight` alone: that place weighs as much as the new
    name's (a small model renamed `"proj.weight"` with `weights`)."""
    before = 'weights = {}\nweights[f"{p}.weight"] = w\nweight_b = weights\n'
    after = data.rename(before, "weights", "row_response")
    focus = data.rename_focus([("weights", "row_response")])
    sites = [after[a:b] for a, b in data.focus_spans(after, focus)]
    assert sites == ["row_response ", "\nrow_response[", ".weight\"", " row_response\n"]


def test_training_renames_prefer_names_with_look_alikes_and_evaluations_stay_put():
    """Training's renames pick names with a look-alike (`confused`) more often; the default weight
    leaves the evaluations' held-out picks exactly as before."""
    code = "".join(f"def f{i}(value, value_max, item):\n    return value + value_max + item + item\n" for i in range(5))
    assert data.confused("value", {"value", "value_max", "item"}) and not data.confused("item", {"value", "item"})
    picks = lambda w: [data.pick_identifier(code, random.Random(s), confused_weight=w) for s in range(400)]  # noqa: E731
    plain, preferred = picks(1.0), picks(data.CONFUSED_WEIGHT)
    assert preferred.count("item") < plain.count("item") / 1.5  # the one name without a look-alike
    assert plain == [data.pick_identifier(code, random.Random(s)) for s in range(400)]
