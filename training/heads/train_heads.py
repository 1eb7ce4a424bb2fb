"""Train one DFlash and one DSpark head for the bundled reference model, export both in
their published layouts.

    PYTHONUNBUFFERED=1 python3 training/heads/train_heads.py --target engine/reference_model --out OUT

Loads the reference model's safetensors into the PyTorch Qwen3 it was trained with
(training/qwen3_torch.py), draws rows from the same data pipeline (training/data.py),
computes the target's hidden states and distributions on them (no grad), and trains
both heads on the same batches: loss = 0.1 x cross-entropy on the data + 0.9 x the L1
distance between the head's and the target's distributions (DeepSpec's recipe; 1 - L1/2
is the speculative acceptance rate), weighted exp(-j / gamma) by block position; the
DSpark confidence head learns that acceptance rate by BCE. `--smoke` builds a tiny random
target and tokenizer first (a CPU check of the whole path). See README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository: prompts
sys.path.insert(0, str(HERE.parent))  # training/: qwen3_torch, data, bpe, export
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from heads_torch import DFlashHead, DSparkHead, head_forward, init_weights  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# ------------------------------------------------------------------ target


def load_target(path: Path, dev: str):
    from safetensors.torch import load_file

    from qwen3_torch import Qwen3Config, Qwen3ForCausalLM

    cfg_json = json.loads((path / "config.json").read_text())
    model = Qwen3ForCausalLM(Qwen3Config.from_hf(cfg_json))
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model.to(dev).eval(), cfg_json


@torch.no_grad()
def target_pass(model, ids):
    """Raw residual stream after every layer (list), and the final logits (B, T, V)."""
    from qwen3_torch import rope_cos_sin

    cos, sin = rope_cos_sin(model.cfg, ids.shape[1], ids.device)
    x = model.model.embed_tokens(ids)
    outs = []
    for layer in model.model.layers:
        x = layer(x, cos, sin)
        outs.append(x)
    logits = F.linear(model.model.norm(x), model.model.embed_tokens.weight)
    return outs, logits


# ------------------------------------------------------------------ data


def row_source(tok_dir: Path, seq_len: int, seed: int, workers: int, max_files: int):
    """Rows of seq_len + 1 tokens with loss masks, from the reference model's own pipeline."""
    import data
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    code = data.collect(workers=workers)
    eng = data.collect(workers=workers, exts=(".md", ".rst", ".txt"), check=data.english_ok)
    if max_files:
        code, eng = code[:max_files], eng[: max(1, max_files // 10)]
    log("corpus", len(code), "code files", len(eng), "english files")
    return tok, code, eng


def make_batches(tok, code, eng, seq_len, batch, seed, workers):
    import multiprocessing as mp

    import data

    global _W
    _W = dict(tok=tok, code=code, eng=eng, seq_len=seq_len)
    pool = mp.get_context("fork").Pool(max(1, workers))
    k = [0]
    pending = []

    def submit():
        pending.append(pool.apply_async(_rows, ((seed * 1_000_003 + k[0], batch),)))
        k[0] += 1

    for _ in range(2 * workers + 2):
        submit()

    def nxt():
        ids, mask = pending.pop(0).get()
        submit()
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask)

    return nxt, pool


_W: dict = {}


def _rows(args):
    import data

    seed, n = args
    rb = data.RowBuilder(_W["tok"], _W["code"], _W["eng"], _W["seq_len"], seed)
    out = [rb.row() for _ in range(n)]
    return np.array([r[0] for r in out], np.int32), np.array([r[1] for r in out], np.bool_)


# ------------------------------------------------------------------ losses


def sample_anchors(mask: torch.Tensor, A: int, gen: torch.Generator) -> torch.Tensor:
    """A anchors per row among positions whose next token is a training target (DeepSpec)."""
    B, T = mask.shape
    valid = mask[:, 1:].clone()
    valid = torch.cat([valid, torch.zeros(B, 1, dtype=torch.bool, device=mask.device)], 1)
    valid[:, 0] = False
    r = torch.rand(B, T, generator=gen, device="cpu").to(mask.device)
    r[~valid] = 2.0
    return r.argsort(1)[:, :A].sort(1).values


def block_losses(head, logits_fn, h, ids, mask, anchors, tgt_logits, Bk, gamma, ce_a=0.1, l1_a=0.9,
                 markov=None, conf=None):
    """Weighted CE + L1 on every block position that predicts a real, in-range target."""
    B, T = ids.shape
    A = anchors.shape[1]
    off = head.predicts_offset
    j0 = 1 - off  # DFlash predicts from block position 1, DSpark from 0
    pos = torch.arange(j0, Bk, device=ids.device)
    label_idx = anchors[:, :, None] + pos + off  # token predicted at block position j
    in_range = label_idx < T
    li = label_idx.clamp(max=T - 1)
    labels = ids.gather(1, li.view(B, -1)).view(B, A, -1)
    ok = in_range & mask.gather(1, li.view(B, -1)).view(B, A, -1)
    ok = ok.int().cumprod(-1).bool()  # only a contiguous valid prefix of the block counts
    hh = h[:, :, j0:]
    logits = logits_fn(hh).float()
    prev = None
    if markov is not None:
        prev = torch.cat([ids.gather(1, anchors)[:, :, None], labels[:, :, :-1]], -1)
        logits = logits + markov.markov_w2(markov.markov_w1(prev)).float()
    tprobs = F.softmax(tgt_logits.gather(1, (li - 1).view(B, -1, 1).expand(-1, -1, tgt_logits.shape[-1]))
                       .view(B, A, -1, tgt_logits.shape[-1]).float(), -1)
    logp = F.log_softmax(logits, -1)
    w = ok.float() * torch.exp(-(pos - j0).float() / gamma)
    ce = -(logp.gather(-1, labels[..., None])[..., 0])
    l1 = (logp.exp() - tprobs).abs().sum(-1)
    den = w.sum().clamp_min(1e-6)
    loss = (ce_a * ce * w).sum() / den + (l1_a * l1 * w).sum() / den
    accept = (1 - 0.5 * l1).clamp(0, 1).detach()
    if conf is not None:
        feat = torch.cat([hh, markov.markov_w1(prev).to(hh.dtype)], -1)
        c = conf.proj(feat).squeeze(-1).float()
        loss = loss + (F.binary_cross_entropy_with_logits(c, accept, reduction="none") * w).sum() / den
    okf = ok.float()
    per_pos = (accept * okf).sum((0, 1)) / okf.sum((0, 1)).clamp_min(1)
    tau = (accept * okf).cumprod(-1).sum(-1).mean() + 1  # expected tokens per round (greedy-free estimate)
    return loss, per_pos, tau


# ------------------------------------------------------------------ export


def export(head, cfg: dict, out: Path) -> int:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return sum(v.numel() * v.element_size() for v in sd.values())


def head_config(tc: dict, kind: str, layers: int, block: int, taps: list[int], mask_id: int, rank: int) -> dict:
    c = {k: tc[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                            "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size",
                            "max_position_embeddings")}
    c.update(model_type="qwen3", num_hidden_layers=layers, num_target_layers=tc["num_hidden_layers"],
             attention_bias=False, attention_dropout=0.0, hidden_act="silu", tie_word_embeddings=False,
             layer_types=["full_attention"] * layers, torch_dtype="bfloat16", block_size=block)
    if kind == "dflash":
        c.update(architectures=["DFlashDraftModel"],
                 dflash_config={"block_size": block, "mask_token_id": mask_id, "target_layer_ids": taps})
    else:
        c.update(architectures=["Qwen3DSparkModel"], mask_token_id=mask_id, target_layer_ids=taps,
                 num_anchors=0, markov_rank=rank, markov_head_type="vanilla", enable_confidence_head=True,
                 confidence_head_with_markov=True, confidence_threshold=0.2)
    return c


# ------------------------------------------------------------------ main


def smoke_target(dirpath: Path) -> Path:
    """A tiny random target + tokenizer in the reference model's layout (CPU check)."""
    import bpe
    import data
    from export import export_model
    from qwen3_torch import Qwen3Config, Qwen3ForCausalLM

    code = data.collect(workers=2)[:200]
    tok = bpe.train_tokenizer([t for _, t in code], 512)
    bpe.save(tok, dirpath)
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    export_model(m, dirpath)
    return dirpath


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(HERE.parents[1] / "engine" / "reference_model"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--time-budget", type=float, default=300, help="seconds of training for both heads together")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--taps", default="1,3,4")
    ap.add_argument("--dflash-block", type=int, default=8)
    ap.add_argument("--dflash-layers", type=int, default=1)
    ap.add_argument("--dspark-block", type=int, default=7)
    ap.add_argument("--dspark-layers", type=int, default=1)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--mask-token", default="<|endoftext|>", help="token whose embedding marks the block's blanks")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--max-files", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny random target, a few steps (CPU check)")
    args = ap.parse_args()

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    log("torch", torch.__version__, "device", dev, torch.cuda.get_device_name() if dev == "cuda" else "")
    target_dir = Path(args.target)
    if args.smoke:
        target_dir = smoke_target(Path(tempfile.mkdtemp(prefix="tiny-target-")))
        args.taps, args.seq_len, args.batch, args.anchors = "0,1,2", 128, 4, 8
        args.max_files = args.max_files or 300
    model, tc = load_target(target_dir, dev)
    n_layers = tc["num_hidden_layers"]
    taps = [int(t) for t in args.taps.split(",")]
    assert all(0 <= t < n_layers for t in taps), f"taps {taps} outside the target's {n_layers} layers"
    tok, code, eng = row_source(target_dir, args.seq_len, args.seed, args.workers, args.max_files)
    mask_id = tok.token_to_id(args.mask_token)
    assert mask_id is not None, args.mask_token
    log("target", target_dir, "layers", n_layers, "hidden", tc["hidden_size"], "vocab", tc["vocab_size"],
        "taps", taps, "mask id", mask_id)
    embed_w = model.model.embed_tokens.weight  # frozen, shared with the target
    H = tc["hidden_size"]

    cfgs = {
        "dflash": head_config(tc, "dflash", args.dflash_layers, args.dflash_block, taps, mask_id, 0),
        "dspark": head_config(tc, "dspark", args.dspark_layers, args.dspark_block, taps, mask_id, args.markov_rank),
    }
    heads = {
        "dflash": DFlashHead(cfgs["dflash"], len(taps), H),
        "dspark": DSparkHead(cfgs["dspark"], len(taps), H, tc["vocab_size"], args.markov_rank),
    }
    opts = {}
    for k, h in heads.items():
        init_weights(h, n_layers=cfgs[k]["num_hidden_layers"])
        h.to(dev).train()
        opts[k] = torch.optim.AdamW(h.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        log(k, "params %.2fM" % (sum(p.numel() for p in h.parameters()) / 1e6))

    nxt, pool = make_batches(tok, code, eng, args.seq_len, args.batch, args.seed, args.workers)
    gen = torch.Generator().manual_seed(args.seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev == "cuda" else torch.autocast("cpu", enabled=False)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    lm = lambda x: F.linear(x, embed_w.to(x.dtype))  # noqa: E731  tied LM head of the target
    t_start, step, hist = time.time(), 0, {k: [] for k in heads}
    warm = 50
    while step < args.max_steps and (time.time() - t_start) < args.time_budget:
        progress = (time.time() - t_start) / args.time_budget
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        x, m = nxt()
        ids, mask = x[:, :-1].to(dev), m[:, :-1].to(dev)  # rows are seq_len + 1 long; use seq_len
        with amp:
            outs, tlogits = target_pass(model, ids)
            feats = torch.cat([outs[t] for t in taps], -1).detach()
            anchors = sample_anchors(mask, args.anchors, gen)
            for k, head in heads.items():
                for g in opts[k].param_groups:
                    g["lr"] = lr
                Bk = cfgs[k]["block_size"]
                h = head_forward(head, embed_w, ids, feats, anchors, mask_id, Bk)
                loss, per_pos, tau = block_losses(
                    head, lm, h, ids, mask, anchors, tlogits, Bk, gamma=4.0 if k == "dspark" else 7.0,
                    markov=head.markov_head if k == "dspark" else None,
                    conf=head.confidence_head if k == "dspark" else None)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opts[k].step()
                opts[k].zero_grad(set_to_none=True)
                hist[k].append((loss.item(), tau.item(), per_pos.tolist()))
        step += 1
        if step % 25 == 0 or step <= 2:
            msg = " | ".join(f"{k} loss {np.mean([a for a, _, _ in v[-25:]]):.3f} tau {np.mean([b for _, b, _ in v[-25:]]):.2f}"
                             for k, v in hist.items())
            log(f"step {step} lr {lr:.2e} {msg}")
    pool.terminate()
    log("trained", step, "steps in %.0fs" % (time.time() - t_start))

    out = Path(args.out)
    report = {"steps": step, "seconds": time.time() - t_start, "taps": taps, "mask_token_id": mask_id,
              "seq_len": args.seq_len, "batch": args.batch, "anchors": args.anchors}
    for k, head in heads.items():
        head.eval()
        nbytes = export(head, cfgs[k], out / k)
        last = hist[k][-20:]
        report[k] = {"bytes": nbytes, "final_loss": float(np.mean([a for a, _, _ in last])),
                     "tau_estimate": float(np.mean([b for _, b, _ in last])),
                     "accept_by_position": np.mean([c for _, _, c in last], 0).round(3).tolist(),
                     "block_size": cfgs[k]["block_size"], "layers": cfgs[k]["num_hidden_layers"]}
        log("exported", k, "%.1f MB" % (nbytes / 1e6), report[k])
    (out / "heads_train_report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
