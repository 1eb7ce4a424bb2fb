"""Training data for the reference model: corpus collection and synthetic code-editing tasks.

No torch here (the MLX evaluation imports this module too).

Corpus: every ``*.py`` under the running interpreter's site-packages (and dist-packages),
never anything from a Python standard library: paths under ``sysconfig`` 'stdlib' of this or
any other interpreter found, and any path matching ``/lib/python3.N/`` that is not inside
site-packages/dist-packages, are dropped. Files are deduplicated by a hash of their
normalised text (trailing spaces and blank lines removed). English text: README/METADATA/
.md/.rst/.txt files from the same site-packages.

Tasks (chat format, prompts from ``prompts/``): rename an identifier throughout an excerpt
and re-emit it; apply a one-line edit and re-emit; a two-step rewrite; continue a file.
"""

from __future__ import annotations

import bisect
import hashlib
import keyword
import builtins
import os
import random
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import prompts  # noqa: E402

# ---------------------------------------------------------------- corpus


def stdlib_dirs() -> list[str]:
    dirs = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
    for base in ("/usr/lib", "/usr/local/lib", "/opt", "/root/.pyenv/versions"):
        if os.path.isdir(base):
            for p in Path(base).glob("**/lib/python3.*") if base.endswith("versions") else Path(base).glob("python3.*"):
                dirs.add(str(p))
    return sorted(os.path.realpath(d) for d in dirs if d)


_STDLIB_RE = re.compile(r"/lib(64)?/python3(\.\d+)?/")


def is_stdlib_path(path: str, std_dirs: list[str]) -> bool:
    rp = os.path.realpath(path)
    if "/site-packages/" in rp or "/dist-packages/" in rp:
        # site-packages that sits inside a stdlib dir is still third-party code
        return False
    if any(rp == d or rp.startswith(d + "/") for d in std_dirs):
        return True
    return bool(_STDLIB_RE.search(rp))


def site_dirs() -> list[str]:
    import site

    dirs = set(site.getsitepackages()) | {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return sorted(d for d in dirs if os.path.isdir(d))


def list_files(roots: list[str], exts=(".py",)) -> list[str]:
    std = stdlib_dirs()
    out = []
    for r in roots:
        for dp, dn, fn in os.walk(r):
            dn.sort()
            for f in sorted(fn):
                if f.endswith(exts) or (exts != (".py",) and f in ("METADATA", "README")):
                    p = os.path.join(dp, f)
                    if not is_stdlib_path(p, std):
                        out.append(p)
    return sorted(set(out))


def normalise(text: str) -> str:
    return "\n".join(l.rstrip() for l in text.splitlines() if l.strip())


def read_text(path: str, max_bytes: int = 400_000) -> str | None:
    try:
        if os.path.getsize(path) > max_bytes:
            return None
        t = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    t = t.replace("\r\n", "\n").replace("\t", "    ")
    return t


def code_ok(t: str) -> bool:
    lines = t.splitlines()
    if len(lines) < 5 or "\x00" in t:
        return False
    longest = max(len(l) for l in lines)
    return longest <= 400 and len(t) / len(lines) < 80


def _read_one(path):
    t = read_text(path)
    if t is None:
        return None
    return path, t


def collect(roots: list[str] | None = None, workers: int = 8, exts=(".py",), check=code_ok):
    """[(path relative to its root, text)] deduplicated, sorted by path."""
    roots = roots or site_dirs()
    paths = list_files(roots, exts)
    if workers > 1:
        from multiprocessing import Pool

        with Pool(workers) as pool:
            res = pool.map(_read_one, paths, chunksize=64)
    else:
        res = [_read_one(p) for p in paths]
    seen, out = set(), []
    for r in res:
        if r is None:
            continue
        p, t = r
        if not check(t):
            continue
        h = hashlib.sha1(normalise(t).encode()).digest()
        if h in seen:
            continue
        seen.add(h)
        rel = p
        for root in roots:
            if p.startswith(root.rstrip("/") + "/"):
                rel = p[len(root.rstrip("/")) + 1 :]
                break
        out.append((rel, t))
    return out


def english_ok(t: str) -> bool:
    return len(t) > 200 and sum(c.isalpha() or c.isspace() for c in t[:5000]) / min(len(t), 5000) > 0.75


# ---------------------------------------------------------------- excerpts and edits

IDENT_RE = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z_][A-Za-z0-9_]*(?![A-Za-z0-9_])")
_RESERVED = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | {"self", "cls"}
_DEF_RE = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+([A-Za-z_]\w*)|^\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=[^=]", re.M)


def name_pattern(name: str) -> str:
    """A regex for identifier ``name`` as a whole word."""
    return r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])"


def rename(code: str, old: str, new: str) -> str:
    """Replace every whole-word occurrence of identifier ``old`` with ``new``."""
    return re.sub(name_pattern(old), new, code)


def excerpt(text: str, rng: random.Random, min_lines: int, max_lines: int) -> str | None:
    lines = text.splitlines(keepends=True)
    if len(lines) < min_lines:
        return None
    n = rng.randint(min_lines, min(max_lines, len(lines)))
    starts = [i for i in range(0, len(lines) - n + 1) if lines[i][:1] not in (" ", "\n", ")", "]", "}")]
    start = rng.choice(starts) if starts and rng.random() < 0.8 else rng.randint(0, len(lines) - n)
    ex = "".join(lines[start : start + n])
    if "```" in ex or not ex.strip():
        return None
    if not ex.endswith("\n"):
        ex += "\n"
    return ex


def pick_identifier(code: str, rng: random.Random, min_count: int = 2, confused_weight: float = 1.0) -> str | None:
    """An identifier seen at least `min_count` times, names defined in `code` preferred, and
    names with look-alikes in it (`confused`) weighed `confused_weight` times (training asks for
    more of those; the evaluations keep 1, so their held-out tasks stay the same)."""
    counts: dict[str, int] = {}
    for m in IDENT_RE.finditer(code):
        counts[m.group(0)] = counts.get(m.group(0), 0) + 1
    defined = {a or b for a, b in _DEF_RE.findall(code)}
    cands = [w for w, c in counts.items() if c >= min_count and len(w) >= 2 and w not in _RESERVED]
    if not cands:
        return None
    cands.sort()
    weights = [(4.0 if w in defined else 1.0) * min(counts[w], 8)
               * (confused_weight if confused_weight != 1.0 and confused(w, counts) else 1.0) for w in cands]
    return rng.choices(cands, weights)[0]


def confused(name: str, names) -> bool:
    """Whether another of `names` holds `name` (`func_args_match` for `func_args`) or sits
    inside it (`weight` for `weights`): where a small model's renames go wrong."""
    return any(w != name and (name in w or (len(w) >= 3 and w in name)) for w in names)


WORDS = (
    "value item data result node entry record buffer count index total size name key path "
    "config option state context handler manager client server request response message "
    "token parser reader writer loader builder factory cache store queue stack table row "
    "column field param arg flag mode level limit offset length width height start end "
    "source target input output prefix suffix base root parent child left right first last "
    "new old tmp temp current next prev default extra local remote global inner outer main "
    "user group owner session event signal task job worker thread process stream channel "
    "block chunk frame packet line text word char byte number digit score weight factor "
    "matrix vector point shape region area zone span range window scope layer module unit "
    "check validate compute process update create delete fetch load save parse render build "
    "format convert encode decode apply collect filter merge split join resolve register "
    "is has get set make run read write open close send recv find list map dict info meta "
    "spec schema model view form link file dir url host port addr id uid hash sum avg min max"
).split()


def _split_words(name: str) -> list[str]:
    parts = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)
    return [p.lower() for p in parts] or [name.lower()]


def new_name(old: str, code: str, rng: random.Random) -> str | None:
    lead = re.match(r"_*", old).group(0)
    core = old[len(lead):]
    words = _split_words(core) if core else ["x"]
    style = "upper" if core.isupper() and len(core) > 1 else "camel" if core[:1].isupper() else (
        "lowercamel" if re.search(r"[a-z][A-Z]", core) else "snake")
    for _ in range(20):
        r = rng.random()
        if r < 0.35:
            nw = [rng.choice(WORDS) for _ in range(rng.choice((1, 2, 2, 3)))]
        elif r < 0.6:
            nw = words + [rng.choice(WORDS)]
        elif r < 0.8:
            nw = [rng.choice(WORDS)] + words
        else:
            nw = list(words)
            nw[rng.randrange(len(nw))] = rng.choice(WORDS)
        if style == "upper":
            cand = "_".join(w.upper() for w in nw)
        elif style == "camel":
            cand = "".join(w.capitalize() for w in nw)
        elif style == "lowercamel":
            cand = nw[0] + "".join(w.capitalize() for w in nw[1:])
        else:
            cand = "_".join(nw)
        if rng.random() < 0.1:
            lead = "_" if not lead else ""
        cand = lead + cand
        if (cand != old and cand.isidentifier() and cand not in _RESERVED
                and not re.search(r"(?<![A-Za-z0-9_])" + re.escape(cand) + r"(?![A-Za-z0-9_])", code)):
            return cand
    return None


def make_rename(code: str, rng: random.Random, confused_weight: float = 1.0):
    old = pick_identifier(code, rng, confused_weight=confused_weight)
    if old is None:
        return None
    new = new_name(old, code, rng)
    if new is None:
        return None
    return old, new, rename(code, old, new)


COMMENTS = (
    "TODO: handle this case", "keep in sync with the caller", "see above", "note: may be None",
    "fast path", "fallback", "validate input", "clean up", "for backwards compatibility",
    "debug", "FIXME", "cached", "retry once", "normalise first", "edge case",
)


def make_line_edit(code: str, rng: random.Random):
    """A one-line edit: (instruction, new_code) or None."""
    lines = code.splitlines(keepends=True)
    stripped = [l.strip() for l in lines]
    counts: dict[str, int] = {}
    for s in stripped:
        counts[s] = counts.get(s, 0) + 1
    cands = [i for i, s in enumerate(stripped) if s and counts[s] == 1 and 3 <= len(s) <= 120 and "`" not in s]
    if not cands:
        return None
    i = rng.choice(cands)
    line, s = lines[i], stripped[i]
    indent = line[: len(line) - len(line.lstrip())]
    kind = rng.random()
    if kind < 0.45:
        toks = [m for m in re.finditer(r"[A-Za-z_]\w*|\d+(?:\.\d+)?|'[^'\n]*'|\"[^\"\n]*\"", s)]
        toks = [m for m in toks if m.group(0) not in keyword.kwlist and s.count(m.group(0)) == 1]
        if not toks:
            return None
        a = rng.choice(toks).group(0)
        if a[0].isdigit():
            b = str(rng.randint(0, 4096))
        elif a[0] in "'\"":
            b = a[0] + rng.choice(WORDS) + ("_" + rng.choice(WORDS) if rng.random() < 0.5 else "") + a[0]
        else:
            b = new_name(a, code, rng) or (a + "_" + rng.choice(WORDS))
        if a == b:
            return None
        new_line = line.replace(a, b, 1)
        instr = f"in the line `{s}`, replace `{a}` with `{b}`."
    elif kind < 0.7:
        new_line = ""
        instr = f"delete the line `{s}`."
    else:
        add = "# " + rng.choice(COMMENTS)
        ind = indent + ("    " if s.endswith(":") else "")
        new_line = line + ind + add + "\n"
        instr = f"insert the line `{add}` after the line `{s}`."
    new_lines = lines[:i] + [new_line] + lines[i + 1 :]
    return instr, "".join(new_lines)


# ---------------------------------------------------------------- prompt phrasings
# The canonical phrasing is the template file in prompts/; these alternatives are used
# less often (see P_CANONICAL) so that the model is robust to rewording.

P_CANONICAL = 0.7
ALT_RENAME = [
    "In {path}, rename `{old}` to `{new}` and return the complete file.\n\n{fence}{lang}\n{code}{fence}\n",
    "Replace every occurrence of the identifier `{old}` with `{new}` in this file ({path}). Output the full file.\n\n{fence}{lang}\n{code}{fence}\n",
    "{path}:\n{fence}{lang}\n{code}{fence}\nRename {old} -> {new}. Give back the whole file.\n",
]
ALT_EDIT = [
    "Edit {path}: {instruction}\nReturn the complete file.\n\n{fence}{lang}\n{code}{fence}\n",
    "{path}:\n{fence}{lang}\n{code}{fence}\nChange to make: {instruction}\nOutput the full updated file.\n",
]
ALT_REWRITE = [
    "Update {path}. {instruction}\nOutput the complete file.\n\n{fence}{lang}\n{code}{fence}\n",
]
ALT_CONTINUE = [
    "Here is the start of {path}. Write the rest of it, repeating the beginning.\n\n{fence}{lang}\n{code}{fence}\n",
]
ALTS = {"rename_symbol": ALT_RENAME, "edit_file": ALT_EDIT, "rewrite_file": ALT_REWRITE, "continue_file": ALT_CONTINUE}


def render_user(name: str, rng: random.Random, **fields) -> str:
    if rng.random() < P_CANONICAL:
        return prompts.render(name, **fields)
    return rng.choice(ALTS[name]).format(**prompts.with_derived(fields))


def chat_prefix(user: str, system: str | None) -> str:
    """Exactly what the chat template renders for [system?, user] + add_generation_prompt."""
    s = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return s + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def reply(code: str) -> str:
    return prompts.fence(code) + "<|im_end|>"


@dataclass
class Sample:
    prompt: str  # no loss
    answer: str  # loss (ends with <|im_end|>)
    kind: str
    focus: tuple[str, ...] = ()  # regexes for where the edit is decided (`rename_focus`): weighted loss


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


CONFUSED_WEIGHT = 3.0  # training's renames pick names with look-alikes (`confused`) this much more often


def make_task(kind: str, path: str, text: str, rng: random.Random, min_lines=40, max_lines=300) -> Sample | None:
    ex = excerpt(text, rng, min_lines, max_lines)
    if ex is None:
        return None
    system = prompts.load("system").rstrip("\n") if rng.random() < 0.9 else None
    if kind == "rename":
        r = make_rename(ex, rng, CONFUSED_WEIGHT)
        if r is None:
            return None
        old, new, out = r
        user = render_user("rename_symbol", rng, path=path, old=old, new=new, code=ex)
    elif kind == "edit":
        r = make_line_edit(ex, rng)
        if r is None:
            return None
        instr, out = r
        user = render_user("edit_file", rng, path=path, instruction=_cap(instr), code=ex)
    elif kind == "rewrite":
        r1 = make_rename(ex, rng, CONFUSED_WEIGHT)
        if r1 is None:
            return None
        old, new, mid = r1
        if rng.random() < 0.5:
            r2 = make_rename(mid, rng, CONFUSED_WEIGHT)
            if r2 is None or r2[0] == new:
                return None
            instr = f"Rename `{old}` to `{new}` and `{r2[0]}` to `{r2[1]}`."
            out, renamed = r2[2], ((old, new), r2[:2])
        else:
            r2 = make_line_edit(mid, rng)
            if r2 is None:
                return None
            instr = f"Rename `{old}` to `{new}`, then {r2[0]}"
            out, renamed = r2[1], ((old, new),)
        user = render_user("rewrite_file", rng, path=path, instruction=instr, code=ex)
    elif kind == "continue":
        lines = ex.splitlines(keepends=True)
        k = rng.randint(max(3, len(lines) // 4), max(4, (3 * len(lines)) // 4))
        user = render_user("continue_file", rng, path=path, code="".join(lines[:k]))
        out = ex
    else:
        raise ValueError(kind)
    if out == ex and kind != "continue":
        return None
    focus = rename_focus([(old, new)] if kind == "rename" else renamed if kind == "rewrite" else [])
    return Sample(chat_prefix(user, system), reply(out), kind, focus)


def rename_focus(renames) -> tuple[str, ...]:
    """The focus regexes of renames (old, new): every new name, and the places a small model
    renames by mistake: what is left of each old name in the renamed text (every whole-word
    occurrence is gone, so what is left sits inside a longer identifier: `size` in `size_diff`),
    and whole words that sit inside the old name (`weight` beside `weights`)."""
    return tuple(p for old, new in renames for p in (name_pattern(new), re.escape(old), *inner_words(old)))


def inner_words(name: str, shortest: int = 3) -> tuple[str, ...]:
    """A regex (or none) for whole-word identifiers of at least `shortest` characters found
    inside `name`: `weight`, `eight` and `ghts` inside `weights`."""
    parts = {name[i:j] for i in range(len(name)) for j in range(i + shortest, len(name) + 1)} - {name}
    words = sorted((p for p in parts if p.isidentifier()), key=lambda p: (-len(p), p))
    return (r"(?<![A-Za-z0-9_])(?:" + "|".join(map(re.escape, words)) + r")(?![A-Za-z0-9_])",) if words else ()


# ---------------------------------------------------------------- loss weights

def focus_spans(text: str, patterns) -> list[tuple[int, int]]:
    """Sorted, disjoint character spans of `patterns` (regexes) in `text`, each widened by one
    character a side: where a rename changed the text, and the punctuation touching it (a
    small model drops the dot of `mx.array` when it becomes `mx.number_array`)."""
    spans = sorted((max(0, m.start() - 1), m.end() + 1) for p in patterns for m in re.finditer(p, text))
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def loss_weights(offsets, trained: list[tuple[int, int]], focus: list[tuple[int, int]],
                 focus_weight: int = 1) -> list[int]:
    """Per-token loss weight from the tokens' character `offsets`: 0 for a token that does not
    start inside a `trained` span, `focus_weight` for a trained token overlapping a `focus` span,
    1 otherwise. Both span lists sorted and disjoint."""
    t_starts, f_starts = [a for a, _ in trained], [a for a, _ in focus]
    out = []
    for start, end in offsets:
        i = bisect.bisect_right(t_starts, start) - 1
        if i < 0 or start >= trained[i][1]:
            out.append(0)
            continue
        j = bisect.bisect_left(f_starts, max(end, start + 1)) - 1  # the last focus span starting before the token ends
        out.append(focus_weight if j >= 0 and focus[j][1] > start else 1)
    return out


# ---------------------------------------------------------------- row packing (token level)

MIX = {"rename": 0.60, "edit": 0.10, "rewrite": 0.08, "continue": 0.07, "code": 0.13, "english": 0.02}


class RowBuilder:
    """Packs samples into rows of ``seq_len + 1`` tokens with a per-token loss weight.

    With ``agent_frames`` (agent_data.py), a share of rows opens with one Claude Code session.

    A task sample is never split across rows; the space left at the end of a row is filled
    with raw code. Raw code / English carry loss on every token, task samples on the
    assistant reply only (``mask[t]`` is token t's loss weight: 0 = not a target). With
    ``focus_weight`` > 1, the reply's tokens at a rename's sites weigh that much (`focus_spans`).
    """

    def __init__(self, tok, code_files, english_files, seq_len: int, seed: int, mix=MIX,
                 min_lines=40, max_lines=300, retries=0, agent_frames=None, agent_share=0.0, focus_weight=1):
        self.tok, self.code, self.eng = tok, code_files, english_files
        self.T = seq_len + 1
        self.rng = random.Random(seed)
        self.kinds = list(mix)
        self.weights = [mix[k] for k in self.kinds]
        self.eot = tok.token_to_id("<|endoftext|>")
        self.min_lines, self.max_lines = min_lines, max_lines
        self.stats: dict[str, int] = {}
        self.retries = retries
        self.agent_frames, self.agent_share = agent_frames, agent_share
        self.focus_weight = focus_weight

    def _agent(self):
        """A Claude Code session (agent_data.py) that fits in a row, or None."""
        import agent_data  # here, not at the top: agent_data imports this module

        for _ in range(16):
            path, text = self.rng.choice(self.code)
            session = agent_data.make_session(self.agent_frames, path, text, self.rng)
            if session is None:
                continue
            ids, mask = agent_data.encode_segments(self.tok, *session, focus_weight=self.focus_weight)
            if len(ids) < self.T:
                return ids + [self.eot], mask + [0]
        return None

    def _raw(self, files, n_tokens: int):
        path, text = self.rng.choice(files)
        lines = text.splitlines(keepends=True)
        start = self.rng.randrange(len(lines)) if self.rng.random() < 0.5 else 0
        chunk = "".join(lines[start:])[: n_tokens * 6]
        ids = self.tok.encode(chunk).ids[:n_tokens - 1] + [self.eot]
        return ids, [1] * len(ids)

    def _task(self, kind):
        path, text = self.rng.choice(self.code)
        s = make_task(kind, path, text, self.rng, self.min_lines, self.max_lines)
        if s is None:
            return None
        text = s.prompt + s.answer
        enc = self.tok.encode(text)
        focus = focus_spans(text, s.focus) if self.focus_weight != 1 else []
        mask = loss_weights(enc.offsets, [(len(s.prompt), len(text))], focus, self.focus_weight)
        ids = enc.ids + [self.eot]
        mask = mask + [0]
        return ids, mask

    def row(self):
        ids, mask = [], []
        misses = 0
        if self.agent_frames and self.rng.random() < self.agent_share:  # a session opens the row
            r = self._agent()
            if r is not None:
                ids, mask = r
                self.stats["agent"] = self.stats.get("agent", 0) + sum(map(bool, mask))
        while len(ids) < self.T:
            room = self.T - len(ids)
            kind = self.rng.choices(self.kinds, self.weights)[0]
            if kind in ("code", "english") or room < 256:
                files = self.eng if kind == "english" and self.eng else self.code
                a, m = self._raw(files, room)
                kind = "english" if files is self.eng else "code"
            else:
                r = self._task(kind)
                if r is None:
                    continue
                a, m = r
                if len(a) > self.T:
                    continue
                if len(a) > room and misses < self.retries:
                    misses += 1
                    continue
                if len(a) > room:  # does not fit: fill the rest with code, sample dropped
                    a, m = self._raw(self.code, room)
                    kind = "code"
            self.stats[kind] = self.stats.get(kind, 0) + sum(map(bool, m))
            ids += a
            mask += m
        return ids[: self.T], mask[: self.T]
