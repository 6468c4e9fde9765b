"""Shared pieces of the gefen benchmarks (loss_parity.py, memory.py, step_time.py).

Nothing here is timed by the test suite; the scripts are run by hand (or with --quick as a
smoke test).  See each script's --help.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import sysconfig
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import gefen


def add_common_args(parser) -> None:
    """Arguments every script shares."""
    parser.add_argument("--json", metavar="OUT", default=None,
                        help="also write the results as JSON to OUT")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: all cores)")


def set_threads(n: Optional[int] = None) -> int:
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def parse_list(s: str) -> List[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def write_json(path: Optional[str], obj: Any) -> None:
    if not path:
        return
    import json
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    print(f"wrote {path}")


# --------------------------------------------------------------------------------------
# Machine description
# --------------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    keep = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in flags]
                    return ",".join(keep) or "-"
    except OSError:
        pass
    return "?"


def gefen_version() -> str:
    return f"{gefen.__version__} (core {gefen._C.core_version()}, " \
        f"{'OpenMP' if gefen._C.has_threads() else 'single-threaded'})"


def machine_description() -> str:
    parts = [
        f"cpu: {_cpu_model()} [{_cpu_flags()}], {os.cpu_count()} logical cores",
        f"torch {torch.__version__} (threads={torch.get_num_threads()}, "
        f"interop={torch.get_num_interop_threads()})",
        f"python {platform.python_version()}",
        f"gefen: {gefen_version()}",
        "load average (1/5/15 min) at start: %.2f %.2f %.2f -- other processes skew timings"
        % os.getloadavg(),
    ]
    if torch.cuda.is_available():
        parts.append(f"cuda: {torch.cuda.get_device_name(0)} (cuda {torch.version.cuda})")
    else:
        parts.append("cuda: none")
    return "\n".join("# " + p for p in parts)


def machine_info() -> Dict[str, Any]:
    return {
        "cpu": _cpu_model(), "cpu_flags": _cpu_flags(), "cores": os.cpu_count(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "python": platform.python_version(), "gefen": gefen_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg": os.getloadavg(),
    }


def print_header(title: str, config: Dict[str, Any]) -> None:
    print("#" * 88)
    print(f"# {title}")
    print(machine_description())
    print("# config: " + ", ".join(f"{k}={v}" for k, v in config.items()))
    print("#" * 88, flush=True)


# --------------------------------------------------------------------------------------
# Corpus: the Python standard library's own source code (no download needed)
# --------------------------------------------------------------------------------------

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def load_corpus(max_bytes: int = 8 * 1024 * 1024, val_fraction: float = 0.1
                ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, Any]]:
    """Byte-level corpus (vocab 256) from the stdlib's .py files.

    Files are visited in sorted path order (deterministic), test directories and
    site-packages are skipped, contents are concatenated as raw UTF-8 bytes and capped at
    ``max_bytes``.  The last ``val_fraction`` of the bytes is the validation split.
    Returns (train uint8 tensor, val uint8 tensor, info dict).
    """
    root = sysconfig.get_paths()["stdlib"]
    paths: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test_")]
        for fn in filenames:
            if fn.endswith(".py") and not fn.startswith("test_"):
                paths.append(os.path.join(dirpath, fn))
    paths.sort()
    chunks: List[bytes] = []
    total = 0
    nfiles = 0
    for p in paths:
        if total >= max_bytes:
            break
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        nfiles += 1
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 100_000:
        raise RuntimeError(f"stdlib corpus too small ({len(blob)} bytes from {root})")
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    n_val = int(len(data) * val_fraction)
    train, val = data[: len(data) - n_val].clone(), data[len(data) - n_val:].clone()
    info = {"root": root, "files": nfiles, "bytes": len(blob), "train_bytes": len(train),
            "val_bytes": len(val)}
    return train, val, info


# --------------------------------------------------------------------------------------
# A small GPT (also used at GPT-2-small shape)
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 256
    ctx: int = 128
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    d_mlp: int = 512
    bias: bool = True
    tie_head: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        h = self.n_head
        q = q.view(B, T, h, C // h).transpose(1, 2)
        k = k.view(B, T, h, C // h).transpose(1, 2)
        v = v.view(B, T, h, C // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-LN GPT: tok_embed + pos_embed -> blocks -> ln_f -> lm_head (untied unless
    cfg.tie_head).  Parameter names contain 'embed' / 'lm_head' so a Muon router sends the
    embeddings and the head to the backup optimizer."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.ctx, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_head:
            self.lm_head.weight = self.tok_embed.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                std = resid_std if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weight
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.tok_embed(idx) + self.pos_embed(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def char_transformer(n_layer: int = 4, d_model: int = 128, n_head: int = 4,
                     ctx: int = 128, d_mlp: Optional[int] = None) -> GPT:
    return GPT(GPTConfig(vocab_size=256, ctx=ctx, n_layer=n_layer, d_model=d_model,
                         n_head=n_head, d_mlp=d_mlp or 4 * d_model, bias=True, tie_head=False))


GPT2_SMALL = GPTConfig(vocab_size=50257, ctx=1024, n_layer=12, d_model=768, n_head=12,
                       d_mlp=3072, bias=True, tie_head=True)


def gpt2_small_shaped(tie_head: bool = True) -> GPT:
    """GPT-2-small shape built locally: vocab 50257, ctx 1024, 12 x (d=768, 12 heads,
    MLP 3072), biases + LayerNorms.  Tied head (as GPT-2): 124.4M params; untied: 163.0M."""
    return GPT(dataclasses.replace(GPT2_SMALL, tie_head=tie_head))


def count_params(model_or_params) -> int:
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) \
        else model_or_params
    seen, n = set(), 0
    for p in params:
        if isinstance(p, tuple):
            p = p[1]
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


# --------------------------------------------------------------------------------------
# Optimizer state bytes
# --------------------------------------------------------------------------------------

def _walk_tensors(obj: Any, key: str = ""):
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_tensors(v, str(k) if not key else f"{key}.{k}")
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_tensors(v, key)


def _tensor_nbytes(t: torch.Tensor) -> Tuple[Any, int]:
    """(dedup key, bytes).  DTensors count their local shard."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.device.type == "meta":
        return None, 0
    try:
        st = local.untyped_storage()
        return (local.device.type, st.data_ptr()), st.nbytes()
    except Exception:  # noqa: BLE001 - exotic tensor subclasses: count the view itself
        nb = local.numel() * local.element_size()
        return (local.device.type, local.data_ptr(), nb), nb


def state_breakdown(optimizer) -> Dict[str, Dict[str, Any]]:
    """Per state key (e.g. 'exp_avg', 'codes'): {'bytes', 'tensors', 'dtypes'}.

    Walks every value of the live ``optimizer.state`` recursively (``state_dict()`` returns
    copies); a storage shared by several parameters (same data_ptr) is counted once,
    attributed to the first key that referenced it; ints/floats count 0."""
    seen = set()
    out: Dict[str, Dict[str, Any]] = {}
    for pstate in list(optimizer.state.values()):
        for key, t in _walk_tensors(pstate):
            dk, nb = _tensor_nbytes(t)
            entry = out.setdefault(key, {"bytes": 0, "tensors": 0, "shared_skipped": 0,
                                         "dtypes": set()})
            entry["dtypes"].add(str(t.dtype).replace("torch.", ""))
            if dk is None:
                continue
            if dk in seen:
                entry["shared_skipped"] += 1
                continue
            seen.add(dk)
            entry["bytes"] += nb
            entry["tensors"] += 1
    for e in out.values():
        e["dtypes"] = ",".join(sorted(e["dtypes"]))
    return out


def state_bytes(optimizer) -> int:
    return sum(e["bytes"] for e in state_breakdown(optimizer).values())


# --------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------

_MUON_EXCLUDE = ("embed", "wte", "wpe", "lm_head", "classifier", "score")


def named_params_of(model_or_named) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(model_or_named, nn.Module):
        return [(n, p) for n, p in model_or_named.named_parameters() if p.requires_grad]
    out = []
    for i, item in enumerate(model_or_named):
        out.append(item if isinstance(item, tuple) else (f"param{i}", item))
    return out


def decay_groups(named: Sequence[Tuple[str, torch.Tensor]], weight_decay: float) -> List[dict]:
    """Decay matrices (ndim >= 2, embeddings included), not biases / norms."""
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def is_muon_param(name: str, p: torch.Tensor, module: Optional[nn.Module] = None,
                  embedding_ids: Optional[set] = None) -> bool:
    """ALGORITHM.md §8 routing rule."""
    if p.ndim != 2:
        return False
    lname = name.lower()
    if any(s in lname for s in _MUON_EXCLUDE):
        return False
    if embedding_ids is not None and id(p) in embedding_ids:
        return False
    return True


def _embedding_ids(model: Optional[nn.Module]) -> set:
    if model is None:
        return set()
    return {id(m.weight) for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def make_adamw(params, lr: float, weight_decay: float = 0.0, mode: str = "auto", **kw):
    """mode: 'fused' (error if unsupported), 'foreach', 'forloop', or 'auto' (fused if the
    build supports it for these tensors, else foreach)."""
    kw.setdefault("betas", (0.9, 0.999))
    kw.setdefault("eps", 1e-8)
    params = list(params)
    if mode == "fused":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True, **kw)
    if mode == "foreach":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True, **kw)
    if mode == "forloop":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False, **kw)
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True, **kw)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True, **kw)


class MultiOptimizer:
    """Drives several optimizers as one: step / zero_grad / state_dict / param_groups.
    state_dict()['state'] is the union of the children's states, re-keyed 0..N-1 in child
    order (so state_bytes() works on it)."""

    def __init__(self, children: Dict[str, Any]):
        self.children = dict(children)

    @property
    def param_groups(self) -> List[dict]:
        return [g for o in self.children.values() for g in o.param_groups]

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.children.values():
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.children.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for role, o in self.children.items():
            sd = o.state_dict()
            n = sum(len(g["params"]) for g in sd["param_groups"])
            for k, v in sd["state"].items():
                state[offset + int(k)] = v
            for g in sd["param_groups"]:
                g = dict(g)
                g["params"] = [offset + int(i) for i in g["params"]]
                g["role"] = role
                groups.append(g)
            offset += n
        return {"state": state, "param_groups": groups}


def make_muon_adamw(model_or_named, lr: float, weight_decay: float = 0.0,
                    muon_cls=None, betas=(0.9, 0.999), **muon_kw) -> MultiOptimizer:
    """torch.optim.Muon for 2-D hidden matrices (ALGORITHM §8 routing) + AdamW for the rest.
    Muon uses adjust_lr_fn='match_rms_adamw' so one lr serves both halves (Moonlight
    convention; gefen's Hybrid defaults to the same)."""
    module = model_or_named if isinstance(model_or_named, nn.Module) else None
    emb = _embedding_ids(module)
    named = named_params_of(model_or_named)
    muon_p = [p for n, p in named if is_muon_param(n, p, module, emb)]
    rest = [(n, p) for n, p in named if not is_muon_param(n, p, module, emb)]
    muon_cls = muon_cls or torch.optim.Muon
    muon_kw.setdefault("adjust_lr_fn", "match_rms_adamw")
    muon_kw.setdefault("momentum", 0.95)
    children = {}
    if muon_p:
        children["muon"] = muon_cls(muon_p, lr=lr, weight_decay=weight_decay, **muon_kw)
    if rest:
        children["backup"] = make_adamw(decay_groups(rest, weight_decay), lr=lr,
                                        weight_decay=weight_decay, betas=betas)
    return MultiOptimizer(children)


# ---- registry ------------------------------------------------------------------------

def _build_adamw(model, lr, wd, betas=(0.9, 0.999), mode="auto"):
    return make_adamw(decay_groups(named_params_of(model), wd), lr=lr, weight_decay=wd,
                      mode=mode, betas=betas)


def _build_gefen(model, lr, wd, betas=(0.9, 0.999), factored=True):
    Gefen = gefen.Gefen
    return Gefen(decay_groups(named_params_of(model), wd), lr=lr, betas=betas,
                 eps=1e-8, weight_decay=wd, factored=factored, period="auto")


def _build_muon_only(model, lr, wd, betas=None, cls=None):
    named = named_params_of(model)
    bad = [n for n, p in named if p.ndim != 2]
    if bad:
        raise ValueError(f"muon/gefenmuon take 2-D parameters only; got {bad[:3]}...")
    cls = cls or torch.optim.Muon
    return cls([p for _, p in named], lr=lr, weight_decay=wd, momentum=0.95)


def _build_gefenmuon(model, lr, wd, betas=None):
    return _build_muon_only(model, lr, wd, cls=gefen.GefenMuon)


def _build_hybrid(model, lr, wd, betas=(0.9, 0.999), backup="gefen"):
    Hybrid = gefen.GefenMuonHybrid
    if not isinstance(model, nn.Module):
        raise ValueError("GefenMuonHybrid needs an nn.Module")
    return Hybrid(model, lr=lr, backup_optimizer=backup, weight_decay=wd, betas=betas)


# name -> (builder(model_or_named, lr, wd, betas), needs gefen, description); betas are the
# AdamW-style betas of the Adam(-like) part (Muon momentum stays 0.95)
OPTIMIZERS: Dict[str, Tuple[Any, bool, str]] = {
    "adamw": (_build_adamw, False, "torch.optim.AdamW (fused if supported, else foreach)"),
    "adamw-fused": (lambda m, lr, wd, b: _build_adamw(m, lr, wd, b, "fused"), False,
                    "torch.optim.AdamW(fused=True)"),
    "adamw-foreach": (lambda m, lr, wd, b: _build_adamw(m, lr, wd, b, "foreach"), False,
                      "torch.optim.AdamW(foreach=True)"),
    "gefen": (lambda m, lr, wd, b: _build_gefen(m, lr, wd, b, True), True,
              "gefen.Gefen(factored=True)"),
    "gefen-block": (lambda m, lr, wd, b: _build_gefen(m, lr, wd, b, False), True,
                    "gefen.Gefen(factored=False)"),
    "muon": (_build_muon_only, False, "torch.optim.Muon (2-D params only)"),
    "gefenmuon": (_build_gefenmuon, True, "gefen.GefenMuon (2-D params only)"),
    "muon+adamw": (lambda m, lr, wd, b: make_muon_adamw(m, lr, wd, betas=b), False,
                   "torch.optim.Muon (hidden 2-D, match_rms_adamw) + AdamW (rest)"),
    "hybrid-gefen": (lambda m, lr, wd, b: _build_hybrid(m, lr, wd, b, "gefen"), True,
                     "gefen.GefenMuonHybrid(backup_optimizer='gefen')"),
    "hybrid-adamw": (lambda m, lr, wd, b: _build_hybrid(m, lr, wd, b, "adamw"), True,
                     "gefen.GefenMuonHybrid(backup_optimizer='adamw')"),
}


def make_optimizer(name: str, model, lr: float, weight_decay: float = 0.0,
                   betas: Tuple[float, float] = (0.9, 0.999)):
    """Build optimizer ``name`` for an nn.Module (or a list of (name, param) pairs).
    ``betas`` go to the Adam-like part (AdamW, Gefen, the Muon entries' backup)."""
    if name not in OPTIMIZERS:
        raise KeyError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name][0](model, lr, weight_decay, tuple(betas))


def check_optimizer_names(names: Iterable[str]) -> None:
    bad = [n for n in names if n not in OPTIMIZERS]
    if bad:
        raise SystemExit(f"unknown optimizer(s) {bad}; known: {', '.join(OPTIMIZERS)}")


def lr_factor(step: int, total: int, warmup: int, schedule: str = "cosine",
              final_frac: float = 0.1) -> float:
    """Linear warmup to 1, then cosine (or linear) decay to final_frac at the last step."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup - 1)
    t = min(max(t, 0.0), 1.0)
    if schedule == "cosine":
        return final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t))
    if schedule == "linear":
        return 1.0 - (1.0 - final_frac) * t
    if schedule == "constant":
        return 1.0
    raise ValueError(f"unknown schedule {schedule!r}")
