"""Claude Code sessions as training samples: the CLI's own prompt, then Read, Write, a last word.

The model is taught one agent task in the exact text our server feeds it when the real
Claude Code CLI asks "Rename OLD to NEW in FILE": the CLI's ~25k-token system prompt and tool
schemas, rendered by the model's chat template, then

    turn 1  <tool_call> Read(file_path) </tool_call>          (loss)
    tool    the file as the CLI returns it ("N<TAB>line" per line)
    turn 2  <tool_call> Write(file_path, content=renamed) </tool_call>   (loss)
    turn 3  one closing sentence                             (loss)

Where that text comes from: `capture_sessions.py` runs the real CLI against a recording server
and keeps every request; `frames` (below, run on a machine with this repository's environment)
renders those requests through the server's own request parsing and chat template and stores
the constant parts as *frames*, with the working directory, home, date and task as fields.
The builder here only fills frames and formats tool calls the way the template does; the
`frames` step checks that what it builds equals the server's rendering of every captured
request, so training text and serving text cannot drift apart. Frames hold the CLI's prompt
(third-party text): they travel to the training machine and are never committed.

The CLI sends the third request with both tool calls in one assistant message and both results
in one user message, so turn 3 is trained in that form: a session is either the Read-Write form
(loss on turns 1-2) or the closing form (loss on turn 1 and 3), never both in one sample.

No torch, no MLX, no server imports at module level: the training machine builds samples with
this module and `data.py` only.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402

FIELDS = ("CWD", "HOME", "SLUG", "DATE", "TASK")
END = "<|im_end|>"


def field(name: str) -> str:
    return f"\x00{name}\x00"


def tool_call(name: str, arguments: dict) -> str:
    """A tool call as the chat template writes it (training/chat_template.jinja, `tojson`)."""
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments, ensure_ascii=False) + "}\n</tool_call>"


def read_result(text: str) -> str:
    """What the CLI's Read returns for a whole file: each line numbered, a tab, the line."""
    return "\n".join(f"{i}\t{line}" for i, line in enumerate(text.split("\n"), 1))


def project_slug(cwd: str) -> str:
    """The CLI's per-project directory name: every character not alphanumeric becomes '-'."""
    return re.sub(r"[^A-Za-z0-9]", "-", cwd)


@dataclass
class Frame:
    """One captured CLI version/environment: the first request's text with its fields, and the
    text the CLI returns after a successful Write."""
    prompt: str  # ends with the generation prompt; holds field(...) for FIELDS
    write_result: str  # holds field("PATH")

    def fill(self, **values: str) -> str:
        out = self.prompt
        for k in FIELDS:
            out = out.replace(field(k), values[k.lower()])
        return out


def load_frames(path: str | Path) -> list[Frame]:
    return [Frame(**f) for f in json.loads(Path(path).read_text())]


def session_segments(frame: Frame, env: dict, path: str, before: str, after: str, closing: str,
                     form: str) -> list[tuple[str, bool]]:
    """The session's text as (segment, trained) pairs, in one of the two forms the CLI sends."""
    read = tool_call("Read", {"file_path": path})
    write = tool_call("Write", {"file_path": path, "content": after})
    prompt = frame.fill(**env)
    result = "<tool_response>\n" + read_result(before) + "\n</tool_response>"
    if form == "write":  # the second request: Read's result, then the model writes the file
        return [(prompt, False), (read + END, True),
                ("\n<|im_start|>user\n" + result + END + "\n<|im_start|>assistant\n", False),
                (write + END, True)]
    written = "<tool_response>\n" + frame.write_result.replace(field("PATH"), path) + "\n</tool_response>"
    return [(prompt, False), (read, True),
            ("\n" + write + END + "\n<|im_start|>user\n" + result + "\n" + written + END
             + "\n<|im_start|>assistant\n", False),
            (closing + END, True)]


# ---------------------------------------------------------------- random sessions

ROOTS = ("/home/{u}", "/home/{u}", "/Users/{u}", "/Users/{u}", "/tmp", "/tmp", "/work", "/srv", "/opt", "/mnt/data",
         "/var/tmp", "/root", "/private/var/folders/{a}/{b}/T", "/tmp/pytest-of-{u}/pytest-{n}")
USERS = ("dev", "alice", "bob", "sam", "kim", "lee", "ana", "max", "jo", "user", "runner", "ci", "root", "pat")


def _random_word(rng: random.Random) -> str:
    alnum = "abcdefghijklmnopqrstuvwxyz0123456789"
    r = rng.random()
    if r < 0.35:
        return rng.choice(data.WORDS) + rng.choice(("", "", "s", "-app", "_lib", "2", "-main", "-dev"))
    if r < 0.55:
        return "".join(rng.choice(alnum) for _ in range(rng.randint(3, 10)))
    if r < 0.7:
        return "tmp" + "".join(rng.choice(alnum + "_") for _ in range(8))
    if r < 0.8:
        return rng.choice("wptx") + str(rng.randint(0, 99999))
    if r < 0.9:
        return f"test_{rng.choice(data.WORDS)}{rng.randint(0, 3)}"
    return rng.choice(data.WORDS) + "-" + rng.choice(data.WORDS)


def random_cwd(rng: random.Random, stem: str) -> tuple[str, str]:
    """(working directory, home): random enough that the model must copy them, not guess. A
    directory named after the file (`proj_utils` for utils.py) is in the mix on purpose."""
    u = rng.choice(USERS)
    a, b = ("".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_") for _ in range(k)) for k in (2, 28))
    root = rng.choice(ROOTS).format(u=u, a=a, b=b, n=rng.randint(0, 30))
    parts = [_random_word(rng) for _ in range(rng.choice((1, 1, 2, 2, 3)))]
    if rng.random() < 0.15:
        parts[-1] = rng.choice(("{s}", "proj_{s}", "{s}_project", "{s}-work")).format(s=stem)
    cwd = "/".join([root] + parts)
    home = root if root.startswith(("/home/", "/Users/", "/root")) else rng.choice(("/root", "/home/" + u, "/Users/" + u))
    return cwd, home


RENAME_TASKS = ("Rename {old} to {new} in {rel}", "Rename {old} to {new} in {rel}", "Rename {old} to {new} in {rel}",
                "Rename `{old}` to `{new}` in {rel}", "In {rel}, rename {old} to {new}",
                "rename {old} to {new} in {rel}", "Rename {old} to {new} in {rel}.",
                "Please rename {old} to {new} in {rel}")
RENAME_CLOSINGS = ("Renamed `{old}` to `{new}` in {rel}.", "Renamed {old} to {new} in {rel}.",
                   "Done: `{old}` is now `{new}` in {rel}.")
EDIT_CLOSINGS = ("Done.", "Updated {rel}.", "Edited {rel}.")


def random_env(rng: random.Random, task: str, stem: str) -> dict:
    cwd, home = random_cwd(rng, stem)
    date = f"20{rng.randint(25, 27)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return {"cwd": cwd, "home": home, "slug": project_slug(cwd), "date": date, "task": task}


def make_session(frames: list[Frame], path: str, text: str, rng: random.Random, min_lines=15, max_lines=150,
                 edit_share=0.15) -> tuple[list[tuple[str, bool]], tuple[str, ...]] | None:
    """A random session over `text` (a corpus file at `path`; an excerpt of it when long), or
    None: its (segment, trained) pairs and the focus regexes for `encode_segments` (the path the
    model must copy, and a rename's `data.rename_focus`)."""
    lines = text.count("\n")
    before = text if min_lines <= lines <= max_lines and text.endswith("\n") else data.excerpt(text, rng, min_lines, max_lines)
    if before is None or "\t" in before or "\r" in before:
        return None
    parts = Path(path).parts
    rel = parts[-1] if rng.random() < 0.7 or len(parts) < 2 else "/".join(parts[-2:])
    if rng.random() < edit_share:
        r = data.make_line_edit(before, rng)
        if r is None:
            return None
        instruction, after = r
        task = f"In {rel}, {instruction}"
        closing = rng.choice(EDIT_CLOSINGS).format(rel=rel)
        focus = ()
    else:
        r = data.make_rename(before, rng, data.CONFUSED_WEIGHT)
        if r is None:
            return None
        old, new, after = r
        task = rng.choice(RENAME_TASKS).format(old=old, new=new, rel=rel)
        closing = rng.choice(RENAME_CLOSINGS).format(old=old, new=new, rel=rel)
        focus = data.rename_focus([(old, new)])
    if after == before:
        return None
    env = random_env(rng, task, Path(path).stem)
    form = "write" if rng.random() < 0.8 else "closing"
    path = env["cwd"] + "/" + rel
    segments = session_segments(rng.choice(frames), env, path, before, after, closing, form)
    return segments, (re.escape(path),) + focus


def encode_segments(tok, segments: list[tuple[str, bool]], focus: tuple[str, ...] = (),
                    focus_weight: int = 1) -> tuple[list[int], list[int]]:
    """Token ids of the whole text (one encode, so merges match serving) and each token's loss
    weight (`data.loss_weights`: 0 in the prompt and tool results, `focus_weight` where the
    model's turns match a `focus` regex, 1 elsewhere)."""
    text = "".join(s for s, _ in segments)
    spans, at = [], 0
    for s, trained in segments:
        if trained:
            spans.append((at, at + len(s)))
        at += len(s)
    enc = tok.encode(text)
    focused = data.focus_spans(text, focus) if focus_weight != 1 else []
    return enc.ids, data.loss_weights(enc.offsets, spans, focused, focus_weight)


# ---------------------------------------------------------------- frames from captures

def render_request(tokenizer, body: dict) -> str:
    """The text our server feeds the model for an Anthropic request body."""
    from agent_bridge.apis.anthropic_api import parse_request
    from engine.base.chat import chat_text

    r = parse_request(body, 4096)
    return chat_text(tokenizer, r.messages, r.tools, **r.template_kwargs)


def blocks(body: dict, kind: str) -> list[dict]:
    return [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"] if b.get("type") == kind]


def frame_from_session(tokenizer, requests: list[dict]) -> Frame:
    """A frame from one captured rename session (capture_sessions.py: Read, Write, closing);
    checks that the builder reproduces the server's rendering of every request in it."""
    first, second, third = requests[:3]
    texts = [render_request(tokenizer, b) for b in (first, second, third)]
    task = first["messages"][0]["content"][-1]["text"]
    read, write = blocks(third, "tool_use")
    path, after = write["input"]["file_path"], write["input"]["content"]
    cwd = str(Path(read["input"]["file_path"]).parent)
    result = blocks(third, "tool_result")
    before = "\n".join(line.split("\t", 1)[1] for line in result[0]["content"].split("\n"))
    written = result[1]["content"] if isinstance(result[1]["content"], str) else result[1]["content"][0]["text"]
    date = re.search(r"Today's date is (\d{4}-\d\d-\d\d)", texts[0]).group(1)
    home = re.search(r"memory at `(.*?)/\.claude/projects/", texts[0]).group(1)
    prompt = texts[0]
    for value, name in ((task, "TASK"), (project_slug(cwd), "SLUG"), (home, "HOME"), (cwd, "CWD"), (date, "DATE")):
        if value not in prompt:
            raise ValueError(f"{name} {value!r} not found in the rendered request")
        prompt = prompt.replace(value, field(name))
    frame = Frame(prompt, written.replace(path, field("PATH")))
    env = {"cwd": cwd, "home": home, "slug": project_slug(cwd), "date": date, "task": task}
    for form, want in (("write", texts[1]), ("closing", texts[2])):
        # each request ends where the model's next turn (the last segment) begins
        got = "".join(s for s, _ in session_segments(frame, env, path, before, after, "", form)[:-1])
        if got != want:
            n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise ValueError(f"built {form} session differs from the server's rendering at {n}: "
                             f"{got[n - 80:n + 80]!r} vs {want[n - 80:n + 80]!r}")
    return frame


def build_frames(captures: Path, model_dir: Path) -> list[Frame]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    frames, seen = [], set()
    for log in sorted(captures.glob("session-*.jsonl")):
        requests = [json.loads(line) for line in log.read_text().splitlines()]
        if len(requests) < 3:
            continue
        f = frame_from_session(tokenizer, requests)
        if (f.prompt, f.write_result) not in seen:
            seen.add((f.prompt, f.write_result))
            frames.append(f)
    return frames


def main():
    import argparse

    ap = argparse.ArgumentParser(description="frames: captured CLI sessions -> training frames (checked)")
    ap.add_argument("command", choices=("frames",))
    ap.add_argument("--captures", required=True, help="capture_sessions.py's output directory")
    ap.add_argument("--out", required=True, help="frames JSON to write (keep it out of the repository)")
    ap.add_argument("--model", default=str(data.ROOT / "engine" / "reference_model"))
    args = ap.parse_args()
    sys.path.insert(0, str(data.ROOT))
    frames = build_frames(Path(args.captures), Path(args.model))
    if not frames:
        raise SystemExit(f"no complete session in {args.captures}")
    Path(args.out).write_text(json.dumps([f.__dict__ for f in frames]))
    print(f"{len(frames)} frames, each checked against the server's rendering -> {args.out}")


if __name__ == "__main__":
    main()
