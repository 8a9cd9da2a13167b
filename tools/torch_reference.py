#!/usr/bin/env python3
"""PyTorch reference of the moe.c model: checks a dump written by bin/moe-reference.

    bin/moe-reference --out DIR --steps 10 [moe-train flags ...]
    python3 tools/torch_reference.py DIR [--device cuda|cpu] [--dtype fp32|fp64]

The model is rebuilt from DIR/config.json in plain PyTorch (its own nn.Module, no
Hugging Face), loaded with the C model's initial weights (DIR/params.bin), and then

  (a) one forward on step 0's first micro-batch: logits, ce, aux, z and total are
      compared with DIR/logits.bin and DIR/step0.json;
  (b) one backward of that forward (loss scale 1): every gradient tensor is compared
      with DIR/grads.bin (relative error ||c - ref|| / ||ref|| per tensor);
  (c) DIR/losses.json's steps are replayed with the same batches, gradient
      accumulation, clipping, learning-rate schedule, AdamW and expert-bias update,
      and the per-step losses compared, then the weight update of the whole run
      (final − initial weights, DIR/params_final.bin) per tensor.

For a dump made on CUDA (bf16 activations) the step-0 forward/backward uses the
experts the C run chose (DIR/routing.bin; --routing c): bf16 router logits flip
near-tied top-k choices, a discrete difference that says nothing about the
arithmetic. The routing weights are still computed here, and the number of tokens
whose choice differs is printed.

Everything is written from the math of Megatron Core's semantics (docs/megatron.md), not
translated from the C code: RMSNorm, rotate-half RoPE, causal GQA attention with
optional QK-norm, SwiGLU with fc1 rows [gate; up], every router variant moe.c has (softmax
top-k, pre-softmax, sigmoid + expert bias, group-limited, top-k scaling; ties go to
the lower index), the aux loss (global and per sequence), the z-loss, shared
experts, dense layers, and the expert MLP written as a plain loop over experts with
the routing weight applied after the activation and before fc2.

Exit status: 0 when every check passes, 1 when one fails, 2 when the dump cannot be
read or does not describe a model this script knows.
"""

import argparse
import json
import math
import os
import sys
import time
import warnings

# torch warns once at import when numpy is absent; the reference does not use numpy
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - depends on the machine
    sys.stderr.write("torch_reference.py needs PyTorch 2.x: pip install torch\n")
    sys.exit(2)


# Tolerances, by the backend that made the dump (see tools/README.md for the why).
TOLERANCES = {
    # C on the CPU computes in fp32 with double reductions: it should agree with an
    # fp64 (or fp32) reference to rounding level.
    "cpu": {"logits_rel": 1e-4, "loss_rel": 1e-4, "loss_abs": None, "grad_rel": 1e-3,
            "train_abs": 1e-3, "update_rel": 1e-2},
    # C on CUDA computes activations in bf16 (8 significant bits) with fp32 master weights.
    # The weight update after N steps is only reported: AdamW's m/sqrt(v) turns bf16 noise
    # in near-zero gradients into full-size updates, so it carries no tolerance there.
    "cuda": {"logits_rel": 2e-2, "loss_rel": None, "loss_abs": 2e-2, "grad_rel": 5e-2,
             "train_abs": 5e-2, "update_rel": None},
}


class DumpError(Exception):
    """The dump is missing, truncated or inconsistent."""


# --------------------------------------------------------------------------- config


class Config:
    """The settings the model needs, from config.json ("values" holds typed flag values)."""

    def __init__(self, j):
        v = j["values"]
        self.raw = j
        self.device = j["device"]
        self.L = int(v["num-layers"])
        self.H = int(v["hidden-size"])
        self.Hq = int(v["num-attention-heads"])
        self.Hkv = int(j["num_query_groups"])
        self.D = int(j["head_dim"])
        self.V = int(j["vocab_size"])
        self.T = int(j["seq_length"])
        self.B = int(j["micro_batch_size"])
        self.accum = int(j["accum"])
        self.steps = int(j["steps"])
        self.ffn = int(v["ffn-hidden-size"])
        self.rope_base = float(v["rotary-base"])
        self.eps = float(v["norm-epsilon"])
        self.qk_norm = bool(v["qk-layernorm"])
        self.E = int(v["num-experts"])
        self.F = int(v["moe-ffn-hidden-size"])
        self.k = int(v["moe-router-topk"])
        self.score_fn = v["moe-router-score-function"]
        self.pre_softmax = bool(v["moe-router-pre-softmax"])
        self.num_groups = int(v["moe-router-num-groups"])
        self.group_topk = int(v["moe-router-group-topk"])
        self.scaling = float(v["moe-router-topk-scaling-factor"])
        self.lb_type = v["moe-router-load-balancing-type"]
        self.aux_coeff = float(v["moe-aux-loss-coeff"])
        self.z_coeff = float(v["moe-z-loss-coeff"])
        self.expert_bias = bool(v["moe-router-enable-expert-bias"])
        self.bias_rate = float(v["moe-router-bias-update-rate"])
        self.Fs = int(v["moe-shared-expert-intermediate-size"])
        self.is_moe = [bool(x) for x in j["is_moe_layer"]]
        # optimizer and schedule
        self.train_iters = int(v["train-iters"])
        self.lr = float(v["lr"])
        self.min_lr = float(v["min-lr"])
        self.warmup = int(v["lr-warmup-iters"])
        self.decay_iters = int(v["lr-decay-iters"])
        self.lr_style = v["lr-decay-style"]
        self.wd = float(v["weight-decay"])
        self.beta1 = float(v["adam-beta1"])
        self.beta2 = float(v["adam-beta2"])
        self.adam_eps = float(v["adam-eps"])
        self.clip = float(v["clip-grad"])
        if len(self.is_moe) != self.L:
            raise DumpError("config.json: is_moe_layer has %d entries for %d layers"
                            % (len(self.is_moe), self.L))
        if self.score_fn not in ("softmax", "sigmoid"):
            raise DumpError("unknown --moe-router-score-function %r" % self.score_fn)
        if self.lb_type not in ("aux_loss", "seq_aux_loss", "none"):
            raise DumpError("unknown --moe-router-load-balancing-type %r" % self.lb_type)
        if self.lr_style not in ("cosine", "linear", "constant"):
            raise DumpError("unknown --lr-decay-style %r" % self.lr_style)


def lr_at(c, step):
    """Warmup + cosine/linear/constant schedule, as moe_lr_at() (0-based step)."""
    if c.warmup > 0 and step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    if c.lr_style == "constant":
        return c.lr
    decay_iters = c.decay_iters if c.decay_iters > 0 else c.train_iters
    if step >= decay_iters:
        return c.min_lr
    span = decay_iters - c.warmup
    if span <= 0:
        return c.min_lr
    ratio = (step - c.warmup) / span
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio)) if c.lr_style == "cosine" else 1.0 - ratio
    return c.min_lr + coeff * (c.lr - c.min_lr)


# --------------------------------------------------------------------------- ops


def rmsnorm(x, w, eps):
    """y = x / sqrt(mean(x²) + eps) · w over the last dimension."""
    r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * r * w


def rope_tables(T, D, base, dtype, device):
    """cos/sin [T, D/2] of θ_i(t) = t · base^(−2i/D), computed in fp64."""
    i = torch.arange(D // 2, dtype=torch.float64)
    t = torch.arange(T, dtype=torch.float64)
    theta = t[:, None] * torch.pow(torch.tensor(base, dtype=torch.float64), -2.0 * i / D)[None, :]
    return theta.cos().to(dtype=dtype, device=device), theta.sin().to(dtype=dtype, device=device)


def rope(x, cos, sin):
    """Rotate-half RoPE on x [B, T, heads, D]: halves a, b -> (a cos − b sin, b cos + a sin)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def swiglu(gu):
    """fc1 output rows are [gate | up]: silu(gate) ⊙ up."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def mlp(x, fc1, fc2):
    """SwiGLU MLP with [out, in] weights (nn.Linear layout)."""
    return swiglu(x @ fc1.t()) @ fc2.t()


def topk_lower(v, k):
    """Indices of the k largest entries along the last dim, largest first; ties -> lower index.

    torch.topk does not promise an order among equal values, so this is a stable
    descending sort (equal values keep their index order)."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k]


def select_experts(sel, k, num_groups, group_topk):
    """Top-k of the selection scores [N, E], restricted to the best groups when group-limited.

    A group's score is the sum of its top (k / group_topk) selection scores; the
    group_topk best groups are kept, the other experts masked to -inf, then top-k."""
    if num_groups > 0:
        N, E = sel.shape
        per = E // num_groups
        kg = k // group_topk
        grouped = sel.view(N, num_groups, per)
        top = torch.gather(grouped, -1, topk_lower(grouped, kg))
        group_score = top.sum(dim=-1)
        keep = torch.zeros(N, num_groups, dtype=torch.bool, device=sel.device)
        keep.scatter_(1, topk_lower(group_score, group_topk), True)
        sel = sel.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    return topk_lower(sel, k)


def route(logits, c, bias, forced=None):
    """Router (Megatron's topk_routing_with_score_function). logits [N, E] ->
    (topk_idx [N, k], topk_w [N, k], own_idx). The selection carries no gradient; the
    weights do. With `forced` [N, k] the experts are taken from there (the C run's own
    choice) and only the weights are computed here; own_idx is always this router's choice."""
    k = c.k
    if c.score_fn == "softmax" and c.pre_softmax:
        probs = torch.softmax(logits, dim=-1)
        own = select_experts(probs.detach(), k, c.num_groups, c.group_topk)
        idx = own if forced is None else forced
        w = torch.gather(probs, 1, idx)
    elif c.score_fn == "softmax":
        own = select_experts(logits.detach(), k, c.num_groups, c.group_topk)
        idx = own if forced is None else forced
        w = torch.softmax(torch.gather(logits, 1, idx), dim=-1)
    else:  # sigmoid: select on σ(z) + bias, weights from the unbiased σ(z)
        scores = torch.sigmoid(logits)
        sel = scores.detach()
        if bias is not None:
            sel = sel + bias.to(sel.dtype)
        own = select_experts(sel, k, c.num_groups, c.group_topk)
        idx = own if forced is None else forced
        w = torch.gather(scores, 1, idx)
        if k > 1:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    if c.scaling > 0:
        w = w * c.scaling
    return idx, w, own


def aux_loss(logits, c, group_len):
    """Switch-style load-balancing loss, per group of group_len tokens, mean over groups:
    coeff · E/(k·T²) · Σ_i c_i · Σ_t s_{t,i}; s = softmax over E (sigmoid: σ/Σσ),
    c_i = tokens whose plain top-k of s contains i (counts carry no gradient)."""
    N, E = logits.shape
    if c.score_fn == "softmax":
        s = torch.softmax(logits, dim=-1)
    else:
        sg = torch.sigmoid(logits)
        s = sg / (sg.sum(dim=-1, keepdim=True) + 1e-20)
    groups = N // group_len
    s = s.view(groups, group_len, E)
    idx = topk_lower(s.detach(), c.k)                                # [groups, T, k]
    counts = F.one_hot(idx, E).sum(dim=(1, 2)).to(s.dtype)           # [groups, E]
    per_group = (counts * s.sum(dim=1)).sum(dim=-1) * (
        c.aux_coeff * E / (c.k * group_len * group_len))
    return per_group.mean()


def z_loss(logits, coeff):
    """coeff · mean_t(logsumexp(z_t)²)."""
    return coeff * torch.logsumexp(logits, dim=-1).pow(2).mean()


# --------------------------------------------------------------------------- model
# Module and parameter names reproduce the C parameter table exactly, so
# named_parameters() are "embedding", "layers.0.attn.wq", "layers.1.moe.experts.fc1", ...


def _p(*shape):
    return nn.Parameter(torch.empty(*shape))


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.norm = _p(c.H)
        self.wq = _p(c.Hq * c.D, c.H)
        self.wk = _p(c.Hkv * c.D, c.H)
        self.wv = _p(c.Hkv * c.D, c.H)
        self.wo = _p(c.H, c.Hq * c.D)
        if c.qk_norm:
            self.q_norm = _p(c.D)
            self.k_norm = _p(c.D)

    def forward(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        h = rmsnorm(x, self.norm, c.eps)
        q = (h @ self.wq.t()).view(B, T, c.Hq, c.D)
        k = (h @ self.wk.t()).view(B, T, c.Hkv, c.D)
        v = (h @ self.wv.t()).view(B, T, c.Hkv, c.D)
        if c.qk_norm:  # RMSNorm of every head vector (Qwen3), before RoPE
            q = rmsnorm(q, self.q_norm, c.eps)
            k = rmsnorm(k, self.k_norm, c.eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        rep = c.Hq // c.Hkv  # query head h reads key/value head h // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(c.D)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        y = torch.softmax(s, dim=-1) @ v
        y = y.transpose(1, 2).reshape(B, T, c.Hq * c.D)
        return y @ self.wo.t()


class FFNNorm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = _p(c.H)


class DenseMLP(nn.Module):
    def __init__(self, H, F_):
        super().__init__()
        self.fc1 = _p(2 * F_, H)  # rows [gate; up]
        self.fc2 = _p(H, F_)

    def forward(self, x):
        return mlp(x, self.fc1, self.fc2)


class Experts(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc1 = _p(c.E, 2 * c.F, c.H)
        self.fc2 = _p(c.E, c.H, c.F)


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.router = _p(c.E, c.H)
        self.experts = Experts(c)
        if c.Fs > 0:
            self.shared = DenseMLP(c.H, c.Fs)

    def forward(self, x, bias, forced=None):
        """x [N, H] -> (out [N, H], aux, z, topk_idx, topk_w, own topk_idx)."""
        c = self.c
        N = x.shape[0]
        logits = x @ self.router.t()
        idx, w, own = route(logits, c, bias, forced)
        zero = logits.new_zeros(())
        aux = zero
        if c.lb_type != "none" and c.aux_coeff > 0:
            aux = aux_loss(logits, c, c.T if c.lb_type == "seq_aux_loss" else N)
        z = z_loss(logits, c.z_coeff) if c.z_coeff > 0 else zero
        # the naive loop over experts; the routing weight scales the activation, before fc2
        out = torch.zeros_like(x)
        for e in range(c.E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            a = swiglu(x[tok] @ self.experts.fc1[e].t()) * w[tok, slot].unsqueeze(-1)
            out = out.index_add(0, tok, a @ self.experts.fc2[e].t())
        if c.Fs > 0:
            out = out + self.shared(x)
        return out, aux, z, idx, w, own


class Layer(nn.Module):
    def __init__(self, c, is_moe):
        super().__init__()
        self.c = c
        self.is_moe = is_moe
        self.attn = Attention(c)
        self.ffn = FFNNorm(c)
        if is_moe:
            self.moe = MoE(c)
        else:
            self.mlp = DenseMLP(c.H, c.ffn)

    def forward(self, x, cos, sin, bias, forced=None):
        c = self.c
        B, T, H = x.shape
        x = x + self.attn(x, cos, sin)
        h = rmsnorm(x, self.ffn.norm, c.eps).view(B * T, H)
        if self.is_moe:
            y, aux, z, idx, w, own = self.moe(h, bias, forced)
        else:
            y, aux, z, idx, w, own = self.mlp(h), None, None, None, None, None
        return x + y.view(B, T, H), aux, z, idx, w, own


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embedding = _p(c.V, c.H)
        self.layers = nn.ModuleList([Layer(c, c.is_moe[l]) for l in range(c.L)])
        self.final_norm = _p(c.H)
        self.lm_head = _p(c.V, c.H)
        self._rope = None

    def forward(self, tokens, targets, biases, forced=None):
        """tokens/targets [B, T] -> dict(logits [B·T, V], ce, aux, z, total, per-layer parts).
        forced: None, or per MoE layer the [B·T, k] experts to use (see route())."""
        c = self.c
        B, T = tokens.shape
        if self._rope is None or self._rope[0].shape[0] != T:
            self._rope = rope_tables(T, c.D, c.rope_base, self.embedding.dtype,
                                     self.embedding.device)
        cos, sin = self._rope
        x = self.embedding[tokens]
        zero = x.new_zeros(())
        aux_sum, z_sum = zero, zero
        layer_aux, layer_z, routing = [], [], []
        for l, layer in enumerate(self.layers):
            f = forced[len(routing)] if forced is not None and c.is_moe[l] else None
            x, aux, z, idx, w, own = layer(x, cos, sin,
                                           biases[l] if biases is not None else None, f)
            if aux is not None:
                aux_sum = aux_sum + aux
                z_sum = z_sum + z
                routing.append((idx, w, own))
            layer_aux.append(float(aux.detach()) if aux is not None else 0.0)
            layer_z.append(float(z.detach()) if z is not None else 0.0)
        x = rmsnorm(x, self.final_norm, c.eps)
        logits = (x @ self.lm_head.t()).view(B * T, c.V)
        ce = F.cross_entropy(logits, targets.reshape(-1))
        return {"logits": logits, "ce": ce, "aux": aux_sum, "z": z_sum,
                "total": ce + aux_sum + z_sum, "layer_aux": layer_aux, "layer_z": layer_z,
                "routing": routing}


# --------------------------------------------------------------------------- dump I/O


def read_file(dirpath, name):
    path = os.path.join(dirpath, name)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DumpError("cannot read %s: %s (run bin/moe-reference --out %s first)"
                        % (path, e.strerror, dirpath))


def read_json(dirpath, name):
    try:
        return json.loads(read_file(dirpath, name).decode())
    except ValueError as e:
        raise DumpError("%s/%s is not valid JSON: %s" % (dirpath, name, e))


def read_array(dirpath, name, dtype, count):
    data = read_file(dirpath, name)
    size = torch.tensor([], dtype=dtype).element_size()
    if len(data) != count * size:
        raise DumpError("%s/%s has %d bytes, expected %d (%d values): a truncated or foreign dump"
                        % (dirpath, name, len(data), count * size, count))
    return torch.frombuffer(bytearray(data), dtype=dtype)


def load_params(model, table, flat, total):
    """Copy the flat fp32 buffer into the model by the table's names/offsets/shapes."""
    own = dict(model.named_parameters())
    names = [t["name"] for t in table]
    missing = sorted(set(own) - set(names))
    extra = sorted(set(names) - set(own))
    if missing or extra:
        raise DumpError("parameter tables differ: only in the reference %s, only in the C model %s"
                        % (missing, extra))
    covered = 0
    with torch.no_grad():
        for t in table:
            p = own[t["name"]]
            shape, off, n = tuple(t["shape"]), int(t["offset"]), int(t["numel"])
            if tuple(p.shape) != shape or math.prod(shape) != n or off + n > total:
                raise DumpError("tensor %s: C shape %s (numel %d, offset %d) but reference %s"
                                % (t["name"], shape, n, off, tuple(p.shape)))
            p.copy_(flat[off:off + n].view(shape))
            covered += n
    if covered != total:
        raise DumpError("the table covers %d of %d parameters" % (covered, total))


# --------------------------------------------------------------------------- comparisons


def rel_err(a, b):
    """||a − b|| / ||b|| in fp64 (0 when both are zero; inf when only b is)."""
    a, b = a.double(), b.double()
    nb = b.norm().item()
    nd = (a - b).norm().item()
    if nb == 0.0:
        return 0.0 if nd == 0.0 else float("inf")
    return nd / nb


def scalar_err(a, b):
    """|a − b| / max(|b|, 1e-6) (relative, with a floor for quantities that are zero)."""
    return abs(a - b) / max(abs(b), 1e-6)


class Report:
    def __init__(self):
        self.checks = []  # (name, value, tol, ok)

    def add(self, name, value, tol, kind="rel"):
        ok = bool(value <= tol) if tol is not None else True
        if math.isnan(value):
            ok = False
        self.checks.append((name, value, tol, kind, ok))
        return ok

    @property
    def passed(self):
        return all(ok for *_, ok in self.checks)


def fmt(x):
    return "%.3e" % x if isinstance(x, float) else str(x)


# --------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(
        description="Check a bin/moe-reference dump against a PyTorch reference model.")
    ap.add_argument("dir", help="directory written by bin/moe-reference --out DIR")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="where the reference runs (default: cuda when available, else cpu)")
    ap.add_argument("--dtype", choices=["fp32", "fp64"], default=None,
                    help="reference precision (default: fp64 for a CPU dump, fp32 for a CUDA "
                         "dump)")
    ap.add_argument("--routing", choices=["auto", "own", "c"], default="auto",
                    help="experts for the step-0 forward/backward: own = this reference's "
                         "router decides, c = the C run's choices (routing.bin; the weights are "
                         "still computed here), auto = own for a CPU dump, c for a CUDA dump "
                         "(bf16 logits flip near-tied top-k choices, a discrete difference that "
                         "is not a numerical error)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch (default 1: the models are tiny, and more threads "
                         "only add synchronisation)")
    ap.add_argument("--show-grads", type=int, default=12,
                    help="gradient tensors to list, worst first (default 12; 0 = all)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    args.t0 = time.time()
    try:
        report = run(args)
    except DumpError as e:
        sys.stderr.write("torch_reference.py: error: %s\n" % e)
        return 2
    return 0 if report.passed else 1


def run(args):
    cj = read_json(args.dir, "config.json")
    try:
        c = Config(cj)
    except KeyError as e:
        raise DumpError("config.json lacks %s: written by an older bin/moe-reference?" % e)
    step0 = read_json(args.dir, "step0.json")
    losses = read_json(args.dir, "losses.json")["steps"]
    backend = c.device
    if backend not in TOLERANCES:
        raise DumpError("config.json: unknown device %r" % backend)
    tol = TOLERANCES[backend]
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        raise DumpError("--device cuda: torch sees no GPU")
    dname = args.dtype or ("fp64" if backend == "cpu" else "fp32")
    dtype = torch.float64 if dname == "fp64" else torch.float32
    # a reference means true fp32 matmuls: no TF32 anywhere
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    total = int(cj["total_params"])
    N = c.B * c.T
    params0 = read_array(args.dir, "params.bin", torch.float32, total)
    grads_c = read_array(args.dir, "grads.bin", torch.float32, total)
    logits_c = read_array(args.dir, "logits.bin", torch.float32, N * c.V).view(N, c.V)
    nb = c.steps * c.accum * 2 * N
    batches = read_array(args.dir, "batches.bin", torch.int32, nb).view(
        c.steps, c.accum, 2, c.B, c.T).long()
    n_moe = sum(c.is_moe)
    routing_c = None
    if n_moe:
        raw = read_file(args.dir, "routing.bin")
        per = N * c.k * 4
        if len(raw) == 2 * per * n_moe:
            routing_c = []
            for i in range(n_moe):
                base = 2 * per * i
                idx = torch.frombuffer(bytearray(raw[base:base + per]), dtype=torch.int32)
                w = torch.frombuffer(bytearray(raw[base + per:base + 2 * per]),
                                     dtype=torch.float32)
                routing_c.append((idx.view(N, c.k).long(), w.view(N, c.k)))
    routing_mode = args.routing if args.routing != "auto" else (
        "c" if backend == "cuda" else "own")
    use_c_routing = routing_mode == "c" and n_moe > 0
    if use_c_routing and routing_c is None:
        raise DumpError("--routing c: %s/routing.bin is missing or has the wrong size" % args.dir)
    if len(losses) != c.steps:
        raise DumpError("losses.json has %d steps, config.json says %d" % (len(losses), c.steps))

    print("moe.c vs PyTorch reference: %s" % args.dir)
    print("  C run     : device %s (%s activations), %d parameters, %d layers (%s), "
          "micro-batch %d x %d, accum %d, %d steps"
          % (backend, "bf16" if int(cj["act_size"]) == 2 else "fp32", total, c.L,
             "".join("M" if m else "D" for m in c.is_moe), c.B, c.T, c.accum, c.steps))
    if n_moe:
        router = c.score_fn + (" pre-softmax" if c.pre_softmax else "")
        if c.num_groups:
            router += " group-limited %d/%d" % (c.group_topk, c.num_groups)
        if c.expert_bias:
            router += " + expert bias"
        if c.scaling:
            router += " scaled x%g" % c.scaling
        print("  MoE       : %d experts top-%d, router %s, %s (coeff %g), z-loss %g%s%s"
              % (c.E, c.k, router, c.lb_type, c.aux_coeff, c.z_coeff,
                 ", shared expert %d" % c.Fs if c.Fs else "", ", qk-norm" if c.qk_norm else ""))
    print("  reference : torch %s, %s on %s; step-0 routing: %s" % (
        torch.__version__, dname, dev,
        "the C run's experts" if use_c_routing else "its own router"))
    print("  tolerances: logits rel %g, losses %s %g, grads rel %g per tensor, "
          "train losses abs %g  (C on %s)"
          % (tol["logits_rel"], "abs" if tol["loss_abs"] is not None else "rel",
             tol["loss_abs"] if tol["loss_abs"] is not None else tol["loss_rel"],
             tol["grad_rel"], tol["train_abs"], backend))

    torch.manual_seed(0)
    model = Model(c).to(device=dev, dtype=dtype)
    load_params(model, cj["params"], params0.to(device=dev, dtype=dtype), total)
    params = [p for _, p in model.named_parameters()]
    by_name = dict(model.named_parameters())
    table = cj["params"]
    report = Report()

    def loss_check(name, cval, rval):
        if tol["loss_abs"] is not None:
            err = abs(cval - rval)
            report.add(name, err, tol["loss_abs"], "abs")
        else:
            err = scalar_err(cval, rval)
            report.add(name, err, tol["loss_rel"], "rel")
        return err

    # ------------------------------------------------------------ (a) forward
    zero_bias = ([torch.zeros(c.E, dtype=torch.float32, device=dev) if m else None
                  for m in c.is_moe] if c.expert_bias else None)
    tokens = batches[0, 0, 0].to(dev)
    targets = batches[0, 0, 1].to(dev)
    forced = None
    if use_c_routing:
        forced = [ic.to(dev) for ic, _ in routing_c]
    out = model(tokens, targets, zero_bias, forced)
    lg = out["logits"].detach()
    lc = logits_c.to(dev)
    max_abs = (lc.double() - lg.double()).abs().max().item()
    lrel = rel_err(lc, lg)
    print("\n(a) forward, step 0 micro-batch 0 (%d tokens)%s"
          % (N, ", experts as the C run chose them (--routing c)" if forced else ""))
    print("    %-10s %20s %20s %11s %9s" % ("quantity", "C", "torch", "err", "tol"))
    print("    %-10s %20s %20s %11.3e %9g   (max abs err %.3e)"
          % ("logits", "", "", lrel, tol["logits_rel"], max_abs))
    report.add("forward logits (rel)", lrel, tol["logits_rel"])
    for key in ("ce", "aux", "z", "total"):
        cv, rv = float(step0[key]), float(out[key].item())
        err = loss_check("forward " + key, cv, rv)
        print("    %-10s %20.12f %20.12f %11.3e %9g"
              % (key, cv, rv, err, tol["loss_abs"] if tol["loss_abs"] is not None
                 else tol["loss_rel"]))
    if n_moe and routing_c is not None:
        # which experts this reference's own router picks, against the C run's choice
        mism, total_sel, wmax = 0, 0, 0.0
        for (ic, wc), (ir, wr, own) in zip(routing_c, out["routing"]):
            ic, wc = ic.to(dev), wc.to(dev)
            diff = (ic.sort(dim=-1)[0] != own.sort(dim=-1)[0]).any(dim=-1)
            mism += int(diff.sum())
            total_sel += ic.shape[0]
            same = ~diff
            if same.any():
                # routing weights token by token, in the C order of the experts
                wr_c = torch.gather(
                    torch.zeros(ir.shape[0], c.E, dtype=wr.dtype, device=dev).scatter(
                        1, ir, wr.detach()), 1, ic)
                wmax = max(wmax, (wc.double() - wr_c.double())[same].abs().max().item())
        print("    routing: %d of %d tokens pick different experts here than in the C run "
              "(over %d MoE layer(s)); max |routing weight diff| on the others %.3e "
              "(information)" % (mism, total_sel, n_moe, wmax))

    # ------------------------------------------------------------ (b) backward
    model.zero_grad(set_to_none=False)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    out["total"].backward()
    rows = []
    for t in table:
        p = by_name[t["name"]]
        off, n = int(t["offset"]), int(t["numel"])
        gc = grads_c[off:off + n].to(dev)
        gr = p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros_like(gc)
        rows.append((rel_err(gc, gr), t["name"], gc.double().norm().item(),
                     gr.double().norm().item()))
    rows_sorted = sorted(rows, key=lambda r: -r[0] if not math.isnan(r[0]) else -math.inf)
    worst = rows_sorted[0]
    print("\n(b) backward (loss scale 1): %d gradient tensors, rel err ||C - ref|| / ||ref||"
          % len(rows))
    print("    %-32s %12s %12s %11s" % ("tensor", "||grad C||", "||grad ref||", "rel err"))
    show = rows_sorted if args.show_grads == 0 else rows_sorted[:args.show_grads]
    for r in show:
        print("    %-32s %12.4e %12.4e %11.3e%s"
              % (r[1], r[2], r[3], r[0], "  FAIL" if not r[0] <= tol["grad_rel"] else ""))
    if len(show) < len(rows):
        print("    ... %d more, all better" % (len(rows) - len(show)))
    for r in rows:
        report.add("grad " + r[1], r[0], tol["grad_rel"])
    gall = rel_err(grads_c.to(dev), torch.cat([by_name[t["name"]].grad.reshape(-1)
                                               for t in table]))
    print("    worst: %s at %.3e (tol %g); all gradients together: %.3e"
          % (worst[1], worst[0], tol["grad_rel"], gall))

    # ------------------------------------------------------------ (c) training
    print("\n(c) training, %d steps of %d micro-batch(es), clip %g, AdamW (wd %g), lr schedule %s"
          % (c.steps, c.accum, c.clip, c.wd, c.lr_style))
    # the weights are still the initial ones (the backward above only filled .grad)
    m_state = [torch.zeros(p.shape, dtype=torch.float32, device=dev) for p in params]
    v_state = [torch.zeros(p.shape, dtype=torch.float32, device=dev) for p in params]
    decay = []
    tab = {t["name"]: t for t in table}
    for name, _ in model.named_parameters():
        decay.append(bool(tab[name]["decay"]))
    biases = ([torch.zeros(c.E, dtype=torch.float32, device=dev) if m else None
               for m in c.is_moe] if c.expert_bias else None)
    print("    %4s %14s %14s %10s %11s %11s %10s %10s"
          % ("step", "loss C", "loss torch", "|diff|", "gnorm C", "gnorm torch", "lr C",
             "lr torch"))
    worst_train, worst_lr, worst_gn, worst_part = 0.0, 0.0, 0.0, 0.0
    bias_mismatch = 0
    for step in range(c.steps):
        for p in params:
            p.grad = None
        loss = ce = aux = zl = 0.0
        counts = [torch.zeros(c.E, dtype=torch.float64, device=dev) if m else None
                  for m in c.is_moe]
        for i in range(c.accum):
            tk = batches[step, i, 0].to(dev)
            tg = batches[step, i, 1].to(dev)
            o = model(tk, tg, biases)
            (o["total"] / c.accum).backward()
            loss += o["total"].item() / c.accum
            ce += o["ce"].item() / c.accum
            aux += float(o["aux"].detach()) / c.accum
            zl += float(o["z"].detach()) / c.accum
            j = 0
            for l in range(c.L):
                if c.is_moe[l]:
                    idx = o["routing"][j][0]
                    counts[l] += torch.bincount(idx.reshape(-1), minlength=c.E).double()
                    j += 1
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
            if c.clip > 0 and norm > c.clip:
                s = c.clip / (norm + 1e-6)
                for g in grads:
                    g.mul_(s)
            lr = lr_at(c, step)
            t_ = step + 1
            bc1 = 1.0 - c.beta1 ** t_
            bc2 = 1.0 - c.beta2 ** t_
            for p, g, m_, v_, dec in zip(params, grads, m_state, v_state, decay):
                # the update in fp64 from fp32 moments, as moe_adamw_update()
                g64 = g.double()
                mm = c.beta1 * m_.double() + (1.0 - c.beta1) * g64
                vv = c.beta2 * v_.double() + (1.0 - c.beta2) * g64 * g64
                m_.copy_(mm.float())
                v_.copy_(vv.float())
                upd = (mm / bc1) / (torch.sqrt(vv / bc2) + c.adam_eps)
                if dec:
                    upd = upd + c.wd * p.double()
                p.copy_((p.double() - lr * upd).to(p.dtype))
            if biases is not None:
                for l in range(c.L):
                    if c.is_moe[l]:
                        cnt = counts[l]
                        off = cnt.mean() - cnt
                        biases[l] += (c.bias_rate * torch.sign(off)).float()
        cs = losses[step]
        d = abs(cs["loss"] - loss)
        worst_train = max(worst_train, d)
        worst_lr = max(worst_lr, scalar_err(cs["lr"], lr) if lr else abs(cs["lr"]))
        gn_err = scalar_err(cs["grad_norm"], norm)
        worst_gn = max(worst_gn, gn_err)
        report.add("train step %d loss" % step, d, tol["train_abs"], "abs")
        for key, val in (("ce", ce), ("aux", aux), ("z", zl)):
            dp = abs(cs[key] - val)
            worst_part = max(worst_part, dp)
            report.add("train step %d %s" % (step, key), dp, tol["train_abs"], "abs")
        note = ""
        if biases is not None and "expert_bias" in cs:
            for l in range(c.L):
                if c.is_moe[l]:
                    bc = torch.tensor(cs["expert_bias"][l], dtype=torch.float32)
                    bad = int((bc != biases[l].cpu()).sum())
                    bias_mismatch += bad
                    if bad:
                        note = "  (expert bias differs in %d entries)" % bad
        print("    %4d %14.8f %14.8f %10.3e %11.5f %11.5f %10.3e %10.3e%s%s"
              % (step, cs["loss"], loss, d, cs["grad_norm"], norm, cs["lr"], lr,
                 "" if d <= tol["train_abs"] else "  FAIL", note))
    report.add("learning rate schedule", worst_lr, 1e-9)
    # the weights after the last step: compare the update (final − initial) per tensor
    final_path = os.path.join(args.dir, "params_final.bin")
    upd_rows = []
    if c.steps and os.path.exists(final_path):
        final_c = read_array(args.dir, "params_final.bin", torch.float32, total).to(dev)
        init = params0.to(dev)
        for t in table:
            off, n = int(t["offset"]), int(t["numel"])
            dc = final_c[off:off + n].double() - init[off:off + n].double()
            dr = by_name[t["name"]].detach().reshape(-1).double() - init[off:off + n].double()
            upd_rows.append((rel_err(dc, dr), t["name"]))
        upd_rows.sort(key=lambda r: -r[0])
        for r, name in upd_rows:
            report.add("train update " + name, r, tol["update_rel"])
    if c.steps:
        print("    worst |loss diff| %.3e, of ce/aux/z %.3e (tol %g); worst grad-norm rel diff "
              "%.3e (information); lr schedule rel diff %.1e"
              % (worst_train, worst_part, tol["train_abs"], worst_gn, worst_lr))
        if biases is not None:
            print("    expert bias after every step: %d entries differ from the C run "
                  "(information: a token whose top-k flips moves a count)" % bias_mismatch)
        if upd_rows:
            bad = [r for r in upd_rows
                   if tol["update_rel"] is not None and not r[0] <= tol["update_rel"]]
            print("    weights after step %d: update (final - initial) rel err per tensor, worst "
                  "%.3e at %s (%s)%s"
                  % (c.steps - 1, upd_rows[0][0], upd_rows[0][1],
                     "tol %g" % tol["update_rel"] if tol["update_rel"] is not None
                     else "information", "; %d tensor(s) FAIL" % len(bad) if bad else ""))
            for r, name in bad[:10]:
                print("      FAIL %-32s %.3e" % (name, r))

    # ------------------------------------------------------------ summary
    fails = [ch for ch in report.checks if not ch[4]]
    groups = {}
    for name, value, tl, kind, ok in report.checks:
        g = ("forward" if name.startswith("forward") else "gradients" if name.startswith("grad ")
             else "training" if name.startswith("train") or name.startswith("learning") else name)
        cur = groups.setdefault(g, [0, 0, 0.0])
        cur[0] += 1
        cur[1] += int(not ok)
    print("\nsummary (%s dump, %s reference):" % (backend, dname))
    for g in ("forward", "gradients", "training"):
        if g in groups:
            n, bad, _ = groups[g]
            print("    %-10s %3d checks  %s" % (g, n, "PASS" if bad == 0 else "FAIL (%d)" % bad))
    for name, value, tl, kind, ok in fails[:20]:
        print("    FAIL %s: %s err %.3e > %g" % (name, kind, value, tl))
    print("    (%.1f s)" % (time.time() - args.t0))
    # one machine-readable line for tools/run_reference.sh
    print("SUMMARY logits_rel=%.3e grad_rel=%.3e train_abs=%.3e reference=%s/%s result=%s"
          % (lrel, worst[0], worst_train, dname, dev, "PASS" if report.passed else "FAIL"))
    print("RESULT: %s" % ("PASS" if report.passed else "FAIL"))
    return report


if __name__ == "__main__":
    sys.exit(main())
