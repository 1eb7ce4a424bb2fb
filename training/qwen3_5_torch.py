"""Qwen3.5 (``qwen3_5``) text decoder in plain PyTorch: Gated DeltaNet layers between
full-attention layers, with the parameter names and layouts of the Hugging Face checkpoint,
which mlx-lm's ``qwen3_5`` model class loads (its ``sanitize`` moves the conv axis and turns
the stored norm offsets into weights).

HF layouts kept here (so the export writes ``state_dict()`` unchanged):
- RMSNorm weights are offsets: ``y = norm(x) * (1 + w)``, initialised to 0 (input/post-attention
  layernorms, final norm, q_norm/k_norm). The gated norm inside Gated DeltaNet
  (``linear_attn.norm``) is a plain weight, initialised to 1.
- ``linear_attn.conv1d.weight`` is (C, 1, K) (depthwise, causal).
- Full attention: ``q_proj`` emits [query | gate] per head; output = o_proj(attn * sigmoid(gate));
  RoPE on the first ``partial_rotary_factor`` of each head (rotate-half form).
- Gated DeltaNet: ``in_proj_qkv`` -> causal conv -> silu -> q, k (l2-normalised, q scaled by
  Dk^-0.5), v; ``beta = sigmoid(in_proj_b x)``, ``g = -exp(A_log) * softplus(in_proj_a x + dt_bias)``
  (log decay); value heads share key heads in groups (repeat-interleave, as ``mx.repeat``).

The recurrence is the chunked gated delta rule (`chunk_gated_delta_rule`): inside a chunk of
``chunk`` tokens everything is matmuls (the (I + A)^-1 step is one batched triangular solve),
and only the state is carried through a loop over the chunks of the sequence; all in float32.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from qwen3_torch import MLP, causal_lm_forward, load_weights  # what both decoders share (training/ is on sys.path)


@dataclass
class Qwen35Config:
    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 896
    num_hidden_layers: int = 6
    full_attention_interval: int = 3  # layers 2 and 5 are full attention
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 4
    linear_key_head_dim: int = 64
    linear_num_value_heads: int = 8
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int = 2  # <|im_end|>
    pad_token_id: int = 0  # <|endoftext|>

    def is_linear(self, i: int) -> bool:
        return (i + 1) % self.full_attention_interval != 0

    def hf_config(self) -> dict:
        """config.json that mlx-lm loads as ``qwen3_5`` (a text-only config: mlx-lm wraps it as
        the text_config)."""
        d = asdict(self)
        d.update(
            architectures=["Qwen3_5ForCausalLM"],
            model_type="qwen3_5",
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            layer_types=["linear_attention" if self.is_linear(i) else "full_attention"
                         for i in range(self.num_hidden_layers)],
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
            use_cache=True,
            torch_dtype="bfloat16",
        )
        return dict(sorted(d.items()))

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen35Config":
        d = dict(d.get("text_config") or d)
        rp = d.get("rope_parameters") or {}
        for k in ("rope_theta", "partial_rotary_factor"):
            if k in rp:
                d.setdefault(k, rp[k])
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    """HF Qwen3.5 RMSNorm: the weight is stored as an offset from 1."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class RMSNormGated(nn.Module):
    """norm(x) * w * silu(gate), in float32 (plain weight, initialised to 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf * F.silu(gate.float())).to(x.dtype)


def rope_cos_sin(cfg: Qwen35Config, seq_len: int, device, offset: int = 0):
    d = int(cfg.head_dim * cfg.partial_rotary_factor)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    t = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rope(x, cos, sin):
    # x: (B, H, T, D); the first cos.shape[-1] dims rotate (rotate-half), the rest pass through
    r = cos.shape[-1]
    xr, xp = x[..., :r].float(), x[..., r:]
    x1, x2 = xr.chunk(2, dim=-1)
    rot = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rot.to(x.dtype), xp], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d * 2, bias=False)  # [query | gate] per head
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        c = self.cfg
        q, gate = self.q_proj(x).view(B, T, c.num_attention_heads, 2 * c.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(B, T, -1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        rep = c.num_attention_heads // c.num_key_value_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        dtype = v.dtype  # bf16 under autocast
        o = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v, is_causal=True)
        o = o.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o * torch.sigmoid(gate))


# how (I + L)^-1 is computed: "solve" (batched triangular solve) or "doubling" (matmuls only);
# train.py times both on the device and sets the faster (pick_tri_inverse)
TRI_INVERSE = "solve"


def invert_unit_lower(A, method: str | None = None):
    """(I + L)^-1 for unit lower-triangular A = I + L (batched). "doubling": with N = -L
    nilpotent, (I + L)^-1 = (I + N)(I + N^2)(I + N^4)... (log2(C) squarings, batched matmuls)."""
    C = A.shape[-1]
    eye = torch.eye(C, device=A.device, dtype=A.dtype)
    if (method or TRI_INVERSE) == "solve":
        return torch.linalg.solve_triangular(A, eye.expand_as(A).contiguous(), upper=False, unitriangular=True)
    M = eye - A  # N
    P = eye + M
    for _ in range(max(0, math.ceil(math.log2(C)) - 1)):
        M = M @ M
        P = P + P @ M
    return P


def pick_tri_inverse(device, BH=128, N=16, C=64, Dk=64, reps=3) -> dict:
    """Time both ways of inverting (forward + backward) at training shapes; set the faster."""
    import time

    global TRI_INVERSE
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # leaves the seeded RNG as it was
        k = F.normalize(torch.randn(BH, N, C, Dk, device=device), dim=-1)
        beta = torch.rand(BH, N, C, 1, device=device)
    times = {}
    for method in ("solve", "doubling"):
        for i in range(reps + 1):
            if i == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
            L = ((k * beta) @ k.transpose(-1, -2)).tril(-1).requires_grad_()
            A = L + torch.eye(C, device=device)
            invert_unit_lower(A, method).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times[method] = (time.perf_counter() - t) / reps
    TRI_INVERSE = min(times, key=times.get)
    return {"tri_inverse": TRI_INVERSE, **{f"{m}_ms": round(v * 1e3, 3) for m, v in times.items()}}


def chunk_gated_delta_rule(q, k, v, g, beta, chunk: int = 64, state=None):
    """Gated delta rule over a whole sequence, chunked; float32 throughout.

    q, k: (B, H, T, Dk) (q already scaled, both l2-normalised); v: (B, H, T, Dv);
    g: (B, H, T) log decay (<= 0); beta: (B, H, T). state: (B, H, Dk, Dv) or None.
    Per token: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q.
    Returns o (B, H, T, Dv) and the final state (B, H, Dk, Dv).

    Everything that does not need the state is computed for all chunks at once; the loop over
    chunks does three kernels (new values, decay, state update) and keeps each chunk's
    starting state, from which the outputs are again computed for all chunks at once.
    """
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    pad = (-T) % chunk
    if pad:  # padded tokens have k = v = 0, g = 0: they leave the state unchanged
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N, C, BH = (T + pad) // chunk, chunk, B * H
    q, k, v = (t.reshape(BH, N, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(BH, N, C).cumsum(-1), beta.reshape(BH, N, C)  # g: cumulative log decay
    # decay[i, j] = exp(g_i - g_j) for j <= i (masked before exp: no overflow above the diagonal)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = g[..., :, None] - g[..., None, :]
    decay = torch.where(lower, diff, torch.zeros((), device=q.device)).exp() * lower
    kb = k * beta[..., None]
    # (I + L), L = strictly-lower(beta k k^T * decay): its inverse turns a chunk's per-token
    # delta updates into matmuls (the WY representation); one batched inverse
    A = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(C, device=q.device)
    Tinv = invert_unit_lower(A)
    u = Tinv @ (v * beta[..., None])  # (BH, N, C, Dv): new values if the chunk's start state were 0
    w = Tinv @ (kb * g.exp()[..., None])  # (BH, N, C, Dk): how the start state subtracts from them
    g_last = g[..., -1]  # (BH, N)
    k_tail = (k * (g_last[..., None] - g).exp()[..., None]).transpose(-1, -2).contiguous()  # (BH, N, Dk, C)
    chunk_decay = g_last.exp()[..., None, None]  # (BH, N, 1, 1)
    S = q.new_zeros(BH, Dk, Dv) if state is None else state.float().reshape(BH, Dk, Dv)
    S0, Vn, S = ChunkScan.apply(*(t.transpose(0, 1).contiguous() for t in (u, w, chunk_decay, k_tail)), S)
    S0, Vn = S0.transpose(0, 1), Vn.transpose(0, 1)  # (BH, N, Dk, Dv), (BH, N, C, Dv)
    o = (q * g.exp()[..., None]) @ S0 + ((q @ k.transpose(-1, -2)) * decay) @ Vn
    return o.reshape(B, H, N * C, Dv)[:, :, :T], S.reshape(B, H, Dk, Dv)


class ChunkScan(torch.autograd.Function):
    """The loop over chunks, with its backward written out (a reverse loop of plain kernels: no
    autograd bookkeeping per chunk, which would dominate a GPU step). Chunk-major inputs, so each
    chunk's slice is contiguous: u (N, BH, C, Dv), w (N, BH, C, Dk), d (N, BH, 1, 1),
    kt (N, BH, Dk, C), S (BH, Dk, Dv).

    Per chunk n: V_n = u_n - w_n S_n;  S_{n+1} = d_n S_n + K_n V_n  (K_n = kt_n, Dk x C).
    Returns every chunk's start state S_n (N, BH, Dk, Dv), every V_n (N, BH, C, Dv), the final state.
    """

    @staticmethod
    def forward(ctx, u, w, d, kt, S):
        N = u.shape[0]
        S_all = u.new_empty(N, *S.shape)
        V = torch.empty_like(u)
        for n in range(N):
            S_all[n] = S
            torch.baddbmm(u[n], w[n], S, alpha=-1.0, out=V[n])
            S = torch.baddbmm(S * d[n], kt[n], V[n])
        ctx.save_for_backward(w, d, kt, S_all, V)
        return S_all, V, S

    @staticmethod
    def backward(ctx, g_starts, g_V, g_S):
        w, d, kt, S_all, V = ctx.saved_tensors
        N = V.shape[0]
        # the outer code transposes S_all and V back: their grads arrive strided; one copy each
        g_starts = None if g_starts is None else g_starts.contiguous()
        g_V = None if g_V is None else g_V.contiguous()
        G = torch.zeros_like(S_all[0]) if g_S is None else g_S.contiguous()
        du, dw, dkt = torch.empty_like(V), torch.empty_like(w), torch.empty_like(kt)
        dd = torch.empty_like(d)
        for n in range(N - 1, -1, -1):
            # through S_{n+1} = d_n S_n + K_n V_n
            torch.bmm(G, V[n].transpose(-1, -2), out=dkt[n])
            dV = du[n]
            if g_V is not None:
                torch.baddbmm(g_V[n], kt[n].transpose(-1, -2), G, out=dV)
            else:
                torch.bmm(kt[n].transpose(-1, -2), G, out=dV)
            torch.sum(G * S_all[n], (-1, -2), keepdim=True, out=dd[n])
            # through V_n = u_n - w_n S_n
            torch.bmm(dV, S_all[n].transpose(-1, -2), out=dw[n])
            G = torch.baddbmm(G * d[n], w[n].transpose(-1, -2), dV, alpha=-1.0)
            if g_starts is not None:
                G = G + g_starts[n]
        return du, dw.neg_(), dd, dkt, G


def recurrent_gated_delta_rule(q, k, v, g, beta, state=None):
    """Token-by-token reference of ``chunk_gated_delta_rule`` (tests)."""
    B, H, T, Dk = k.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1], dtype=torch.float32) if state is None else state.float()
    outs = []
    for t in range(T):
        S = S * g[:, :, t, None, None].float().exp()
        kt = k[:, :, t].float()
        delta = (v[:, :, t].float() - (S * kt[..., None]).sum(-2)) * beta[:, :, t, None].float()
        S = S + kt[..., None] * delta[..., None, :]
        outs.append((S * q[:, :, t, :, None].float()).sum(-2))
    return torch.stack(outs, dim=2), S


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.cfg = cfg
        self.hk, self.dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.hv, self.dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        assert self.hv % self.hk == 0
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.K = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=False)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.hv).uniform_(1, 16)))
        self.norm = RMSNormGated(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.chunk = 64

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.in_proj_qkv(x)  # (B, T, C)
        # causal depthwise conv as K shifted multiply-adds (no cuDNN algorithm search, no transposes)
        xp = F.pad(qkv, (0, 0, self.K - 1, 0))
        w = self.conv1d.weight[:, 0].to(qkv.dtype)  # (C, K)
        conv = sum(xp[:, j:j + T] * w[:, j] for j in range(self.K))
        qkv = F.silu(conv)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.hk, self.dk).float()
        k = k.reshape(B, T, self.hk, self.dk).float()
        v = v.reshape(B, T, self.hv, self.dv).float()
        # l2 norm (eps added to the sum of squares), the Dk^-0.5 readout scale folded into q,
        # as mlx-lm's normalize_qk
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * self.dk ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        rep = self.hv // self.hk
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        with torch.autocast(x.device.type, enabled=False):
            o, _ = chunk_gated_delta_rule(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          g.transpose(1, 2), beta.transpose(1, 2), self.chunk)
        o = o.transpose(1, 2)  # (B, T, Hv, Dv)
        z = self.in_proj_z(x).reshape(B, T, self.hv, self.dv)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen35Config, i: int):
        super().__init__()
        self.is_linear = cfg.is_linear(i)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h) if self.is_linear else self.self_attn(h, cos, sin))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35Model(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen35Config, chunk: int = 64):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen35Model(cfg)
        self.set_chunk(chunk)
        self.reset_parameters()

    def set_chunk(self, chunk: int):
        for layer in self.model.layers:
            if layer.is_linear:
                layer.linear_attn.chunk = chunk

    def reset_parameters(self):
        std = self.cfg.initializer_range
        out_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                nn.init.ones_(p)
            elif name.endswith("norm.weight"):
                nn.init.zeros_(p)  # offsets from 1
            elif name.endswith(("dt_bias", "A_log")):
                continue  # set in GatedDeltaNet.__init__
            elif name.endswith("conv1d.weight"):
                nn.init.normal_(p, 0.0, 1.0 / math.sqrt(self.cfg.linear_conv_kernel_dim))
            elif name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids, targets=None, loss_mask=None, output_hidden_states=False):
        """As ``Qwen3ForCausalLM.forward``: logits (B, T, V), or with ``targets`` the mean
        cross-entropy over positions where ``loss_mask`` is set; ``output_hidden_states`` adds
        the input of every layer and the final-normed output."""
        cos, sin = rope_cos_sin(self.cfg, input_ids.shape[1], input_ids.device)
        return causal_lm_forward(self.model, input_ids, cos, sin, targets, loss_mask, output_hidden_states)


def load_pretrained(model_dir, device="cpu", dtype=None) -> Qwen35ForCausalLM:
    """Load an exported model directory (config.json + safetensors shards) into PyTorch."""
    import json
    from pathlib import Path

    d = Path(model_dir)
    model = Qwen35ForCausalLM(Qwen35Config.from_hf(json.loads((d / "config.json").read_text())))
    return load_weights(model, d, device, dtype)
