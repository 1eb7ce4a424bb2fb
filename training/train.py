"""Train the bundled reference model end to end (data, tokenizer, model, export).

    PYTHONUNBUFFERED=1 python3 training/train.py --out OUT_DIR [--time-budget 420]

See training/README.md for the exact command used and the recipe. Everything is seeded;
with ``--time-budget`` the number of steps depends on the machine's speed (the log and
``train_stats.json`` record it; ``--max-steps N --time-budget 0`` replays a fixed length).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import zlib
from collections import deque
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import agent_data  # noqa: E402
import bpe  # noqa: E402
import data  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# ------------------------------------------------------------------ worker side (forked)
_W: dict = {}


def _worker_rows(args):
    seed, n_rows = args
    rb = data.RowBuilder(_W["tok"], _W["code"], _W["eng"], _W["seq_len"], seed, mix=_W["mix"],
                         min_lines=_W["min_lines"], max_lines=_W["max_lines"], retries=_W["retries"],
                         agent_frames=_W["agent_frames"], agent_share=_W["agent_share"],
                         focus_weight=_W["focus_weight"])
    ids = np.empty((n_rows, _W["seq_len"] + 1), np.int32)
    mask = np.empty((n_rows, _W["seq_len"] + 1), np.uint8)  # loss weights
    for i in range(n_rows):
        a, m = rb.row()
        ids[i], mask[i] = a, m
    return ids.astype(np.uint16), mask, rb.stats


def build_model(args, dev):
    """The model to train: from ``--init`` (its config.json says the family) or new, per ``--arch``."""
    if args.init:
        arch = json.loads((Path(args.init) / "config.json").read_text())["model_type"]
        if arch == "qwen3_5":
            from qwen3_5_torch import load_pretrained

            model = load_pretrained(args.init, dev)
            model.set_chunk(args.chunk)
        else:
            from qwen3_torch import load_pretrained

            model = load_pretrained(args.init, dev)
        log("initialised from", args.init, "model_type", arch)
        return model, model.cfg
    if args.arch == "qwen3_5":
        from qwen3_5_torch import Qwen35Config, Qwen35ForCausalLM

        if args.tiny:
            cfg = Qwen35Config(vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                               linear_key_head_dim=32, linear_num_value_heads=4, linear_value_head_dim=16)
        else:
            cfg = Qwen35Config(vocab_size=args.vocab)
        return Qwen35ForCausalLM(cfg, chunk=args.chunk).to(dev), cfg
    from qwen3_torch import Qwen3Config, Qwen3ForCausalLM

    if args.tiny:
        cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:
        cfg = Qwen3Config(vocab_size=args.vocab)
    return Qwen3ForCausalLM(cfg).to(dev), cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tok-sample-mb", type=float, default=48)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--time-budget", type=float, default=420, help="seconds of training (0: use --max-steps)")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--est-steps", type=int, default=0, help="schedule length when time-budget is 0")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--min-lines", type=int, default=40)
    ap.add_argument("--max-lines", type=int, default=300)
    ap.add_argument("--tiny", action="store_true", help="tiny model for a CPU smoke test")
    ap.add_argument("--max-files", type=int, default=0, help="limit corpus (smoke tests)")
    ap.add_argument("--sanity", type=int, default=4, help="greedy rename checks at the end")
    ap.add_argument("--init", help="continue from an exported model directory (stage 2)")
    ap.add_argument("--tokenizer", help="reuse tokenizer.json/tokenizer_config.json from this directory")
    ap.add_argument("--mix", help="task mix, e.g. rename=0.75,edit=0.1,code=0.15 (default data.MIX)")
    ap.add_argument("--pack-retries", type=int, default=0, help="task samples tried before filling a row with code")
    ap.add_argument("--arch", choices=("qwen3", "qwen3_5"), default="qwen3",
                    help="qwen3: the bundled transformer; qwen3_5: the hybrid (Gated DeltaNet + attention)")
    ap.add_argument("--chunk", type=int, default=64, help="Gated DeltaNet chunk length (qwen3_5)")
    ap.add_argument("--tri", choices=("auto", "solve", "doubling"), default="auto",
                    help="qwen3_5: how the chunk's (I + A)^-1 is computed; auto times both on this device")
    ap.add_argument("--export-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="float32 for a stage whose export only initialises the next stage")
    ap.add_argument("--agent-frames", help="frames JSON (agent_data.py frames): rows open with Claude Code sessions")
    ap.add_argument("--agent-share", type=float, default=0.6, help="share of rows that open with a session")
    ap.add_argument("--focus-weight", type=int, default=1,
                    help="loss weight of the reply's tokens at a rename's sites and of the path an agent session copies")
    ap.add_argument("--log-every", type=int, default=25, help="steps between loss / tokens-per-second lines")
    args = ap.parse_args()

    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    log("python", sys.version.split()[0], "torch", torch.__version__, "device", dev,
        torch.cuda.get_device_name() if dev == "cuda" else "", "cpus", os.cpu_count())

    # ---------------- corpus
    log("site dirs", data.site_dirs())
    log("stdlib dirs excluded", data.stdlib_dirs())
    code = data.collect(workers=args.workers)
    eng = data.collect(workers=args.workers, exts=(".md", ".rst", ".txt"), check=data.english_ok)
    if args.max_files:
        code, eng = code[: args.max_files], eng[: args.max_files // 10]
    std = data.stdlib_dirs()
    assert not any(data.is_stdlib_path(p, std) for p, _ in code if p.startswith("/"))
    # hold out ~1% of files (by path hash) for validation
    held = lambda p: zlib.crc32(p.encode()) % 100 == 0  # noqa: E731
    val_code = [f for f in code if held(f[0])]
    code = [f for f in code if not held(f[0])]
    stats = {
        "code_files": len(code), "code_mb": sum(len(t) for _, t in code) / 1e6,
        "val_files": len(val_code), "english_files": len(eng), "english_mb": sum(len(t) for _, t in eng) / 1e6,
    }
    log("corpus", stats)

    # ---------------- tokenizer
    rng = random.Random(args.seed)
    pool_texts, budget = [], args.tok_sample_mb * 1e6
    for _, t in rng.sample(code, len(code)):
        if budget <= 0:
            break
        pool_texts.append(t)
        budget -= len(t)
    eng_texts = [t for _, t in eng][:2000]
    # chat-format examples so the template's words get merged sensibly
    chat_texts = []
    for k in ("rename", "edit", "rewrite", "continue"):
        for i in range(50):
            s = data.make_task(k, *rng.choice(code), rng)
            if s:
                chat_texts.append(s.prompt + s.answer)
    if args.tokenizer:
        from tokenizers import Tokenizer
        import shutil

        tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(args.tokenizer) / f, out / f)
    else:
        tok = bpe.train_tokenizer(pool_texts + eng_texts + chat_texts, args.vocab)
        bpe.save(tok, out)
    sample = "".join(pool_texts[:200])
    n_tok = len(tok.encode(sample).ids)
    stats["tokenizer_bytes_per_token"] = len(sample.encode()) / n_tok
    log("tokenizer trained: vocab", tok.get_vocab_size(), "bytes/token on code %.2f" % stats["tokenizer_bytes_per_token"])
    assert tok.get_vocab_size() == args.vocab

    # ---------------- model
    from export import export_model

    model, cfg = build_model(args, dev)
    if type(model).__name__ == "Qwen35ForCausalLM":
        import qwen3_5_torch

        if args.tri == "auto":
            H = cfg.linear_num_value_heads
            try:
                stats["tri_inverse"] = qwen3_5_torch.pick_tri_inverse(
                    torch.device(dev), BH=args.batch * H, N=max(1, args.seq_len // args.chunk), C=args.chunk,
                    Dk=cfg.linear_key_head_dim)
            except Exception as e:  # a failed probe must not cost the run: the solve always works
                qwen3_5_torch.TRI_INVERSE = "solve"
                stats["tri_inverse"] = {"tri_inverse": "solve", "probe_error": repr(e)[:200]}
            if dev == "cuda":
                torch.cuda.empty_cache()
        else:
            qwen3_5_torch.TRI_INVERSE = args.tri
            stats["tri_inverse"] = {"tri_inverse": args.tri}
        log("gated delta rule: chunk", args.chunk, stats["tri_inverse"])
    n_params = model.num_parameters()
    stats["params"] = n_params
    log("model", cfg, "params %.2fM" % (n_params / 1e6))

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=(dev == "cuda"),
    )

    # ---------------- data workers
    mix = data.MIX
    if args.mix:
        mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
    stats["mix"] = mix
    stats["focus_weight"] = args.focus_weight
    _W.update(tok=tok, code=code, eng=eng, seq_len=args.seq_len, min_lines=args.min_lines, max_lines=args.max_lines,
              mix=mix, retries=args.pack_retries, agent_share=args.agent_share, focus_weight=args.focus_weight,
              agent_frames=agent_data.load_frames(args.agent_frames) if args.agent_frames else None)
    if args.agent_frames:
        stats.update(agent_frames=len(_W["agent_frames"]), agent_share=args.agent_share)
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    pool = ctx.Pool(args.workers)
    pending: deque = deque()
    next_chunk = [0]

    def submit():
        seed = args.seed * 1_000_003 + next_chunk[0]
        pending.append(pool.apply_async(_worker_rows, ((seed, args.batch),)))
        next_chunk[0] += 1

    for _ in range(2 * args.workers + 2):
        submit()
    mix_stats: dict[str, int] = {}

    def next_batch():
        ids, mask, st = pending.popleft().get()
        submit()
        for k, v in st.items():
            mix_stats[k] = mix_stats.get(k, 0) + v
        x = torch.from_numpy(ids.astype(np.int64))
        m = torch.from_numpy(mask)
        if dev == "cuda":
            x, m = x.pin_memory().to(dev, non_blocking=True), m.pin_memory().to(dev, non_blocking=True)
        return x[:, :-1], x[:, 1:], m[:, 1:]

    # ---------------- train
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = torch.autocast(dev, dtype=torch.bfloat16) if dev == "cuda" else torch.autocast("cpu", enabled=False)
    budget = args.time_budget
    est_steps = args.est_steps or args.max_steps
    model.train()
    t_start = time.time()
    step, tokens, loss_ema = 0, 0, None
    while step < args.max_steps:
        elapsed = time.time() - t_start
        if budget and elapsed >= budget:
            break
        progress = elapsed / budget if budget else step / max(1, est_steps)
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps)
        lr *= args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, m = next_batch()
        with amp:
            loss = model(x, targets=y, loss_mask=m)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        if step % args.log_every == 0 or step <= 3:
            lv = loss.item()
            loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
            el = time.time() - t_start
            log(f"step {step} loss {lv:.4f} ema {loss_ema:.4f} gnorm {gn.item():.2f} lr {lr:.2e} "
                f"tok {tokens / 1e6:.1f}M {tokens / el / 1e6:.3f}M tok/s")
    train_time = time.time() - t_start
    stats.update(steps=step, train_tokens=tokens, train_seconds=train_time, final_loss_ema=loss_ema,
                 mix_target_tokens=mix_stats, seq_len=args.seq_len, batch=args.batch)
    pool.terminate()
    log("training done", step, "steps", tokens, "tokens", "%.0fs" % train_time)

    # ---------------- validation on held-out site-packages files
    model.eval()
    _W.update(code=val_code or code, eng=[])
    vr = data.RowBuilder(tok, val_code or code, [], args.seq_len, seed=999, mix={"code": 1.0})
    vt = data.RowBuilder(tok, val_code or code, [], args.seq_len, seed=998, mix={"rename": 1.0},
                         min_lines=args.min_lines, max_lines=args.max_lines)
    with torch.no_grad(), amp:
        for name, rb in (("val_code_loss", vr), ("val_rename_loss", vt)):
            rows = [rb.row() for _ in range(4)]
            x = torch.tensor([r[0] for r in rows], device=dev)
            m = torch.tensor([r[1] for r in rows], device=dev, dtype=torch.bool)
            stats[name] = model(x[:, :-1], targets=x[:, 1:], loss_mask=m[:, 1:]).item()
        if _W["agent_frames"]:  # Claude Code sessions over held-out files: loss on the model's turns only
            arng, losses = random.Random(997), []
            while len(losses) < 4:
                session = agent_data.make_session(_W["agent_frames"], *arng.choice(val_code or code), arng)
                if session is None:
                    continue
                ids, mask = agent_data.encode_segments(tok, *session)
                x = torch.tensor([ids], device=dev)
                m = torch.tensor([mask], device=dev, dtype=torch.bool)
                losses.append(model(x[:, :-1], targets=x[:, 1:], loss_mask=m[:, 1:]).item())
            stats["val_agent_loss"] = sum(losses) / len(losses)
    log("validation", {k: stats[k] for k in ("val_code_loss", "val_rename_loss", "val_agent_loss") if k in stats})

    # ---------------- export
    files = export_model(model, out, dtype=getattr(torch, args.export_dtype))
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2, default=str) + "\n")
    log("exported", files)

    # ---------------- sanity: greedy renames on held-out files (no KV cache; short excerpts)
    srng = random.Random(7)
    ok = 0
    done = 0
    eos = tok.token_to_id("<|im_end|>")
    t_s = time.time()
    while done < args.sanity and time.time() - t_s < 60:
        path, text = srng.choice(val_code or code)
        ex = data.excerpt(text, srng, 30, 50)
        r = ex and data.make_rename(ex, srng)
        if not r:
            continue
        old, new, want = r
        import prompts

        p = data.chat_prefix(prompts.render("rename_symbol", path=path, old=old, new=new, code=ex),
                             prompts.load("system").rstrip("\n"))
        ids = tok.encode(p).ids
        n0 = len(ids)
        target_len = len(tok.encode(data.reply(want)).ids) + 16
        with torch.no_grad(), amp:
            for _ in range(target_len):
                logits = model(torch.tensor([ids], device=dev))[0, -1]
                nxt = int(logits.argmax())
                ids.append(nxt)
                if nxt == eos:
                    break
        got = prompts.extract_code(tok.decode(ids[n0:], skip_special_tokens=False))
        done += 1
        ok += got == want
        log(f"sanity rename {old}->{new}: {'OK' if got == want else 'MISMATCH'}")
        if got != want and done == 1:
            log("output head:", repr(tok.decode(ids[n0:n0 + 120])))
    stats["sanity_rename_ok"] = f"{ok}/{done}"
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2, default=str) + "\n")
    log("sanity", stats["sanity_rename_ok"], "total wall %.0fs" % (time.time() - T0))


if __name__ == "__main__":
    main()
