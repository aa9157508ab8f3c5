"""Benchmark cases: the FFPA table's set, the shapes users run, and the --quick subset.

A `Case` is one attention problem in [B, H, N, D] terms. Families:

* FFPA table (grid over N x D, B=1, H=32):
  `self` (N/N), `cross` (1024/N), `decode` (1/N), `gqa` (Hq/4 KV heads), `causal` (N/N,
  causal), `unaligned` (N-1 / N-1, not a multiple of any tile).
* Shapes users run (D fixed by the model, N a free parameter):
  `gemma4` (Gemma-4 global layer: Hq 32, Hkv 4, D 512, causal, N 4K-16K),
  `mqa` (DeepSeek-V4-style MQA: Hq 64, Hkv 1, D 512, causal),
  `mla` (DeepSeek's absorbed MLA prefill: Hq 128, Hkv 1, Dqk 576, Dv 512 with V = K[..., :512],
  causal; FLOPs 2 B Hq pairs (Dqk + Dv)),
  `mla-decode` (the same heads decoding: B 128, one query per sequence against N 4K-16K keys,
  so each KV head's 128 query rows fill one row tile: the compute-bound regime FlashMLA's dense
  decode measures; `attention` packs the heads into the rows),
  `vae` (diffusion VAE mid-block: B 1, H 1, D 512, N 16K-64K, non-causal, bf16 and fp32 input).
* Dense masks (only when named, alias `masks`; B 4, H 32, D 512, N 4K / 8K, not causal; FLOPs
  on the pairs the mask keeps): `keypad` (bool [B, 1, 1, N], right padding: element b keeps
  its first N (8 - b) / 8 keys), `images` (bool [N, N]: causal text with four bidirectional
  image blocks of N / 16 rows, Gemma's layout), `windowmask` (bool [N, N]: a causal sliding window
  of 128 keys as a dense tensor, as transformers passes DeepSeek-V4's to SDPA).

`--head-dims` and `--seqlens` replace the FFPA grid; for the user families `--seqlens` replaces
their N list and `--head-dims` filters them (their D belongs to the model).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from .flops import attn_flops_bwd, attn_flops_fwd, valid_pairs

FFPA_FAMILIES = ("self", "cross", "decode", "gqa", "causal", "unaligned")
USER_FAMILIES = ("gemma4", "mqa", "mla", "mla-decode", "vae")
ALL_FAMILIES = FFPA_FAMILIES + USER_FAMILIES
# perf/serving.py's rows (their own table; only when named: not part of "all")
SERVING_FAMILIES = ("window", "varlen", "varlen-short", "kvdecode", "kvdecode-fp8",
                    "kvprefill")
# dense masks (`Case.mask`; only when named: not part of "all")
MASK_FAMILIES = ("keypad", "images", "windowmask")
FAMILY_ALIASES = {"ffpa": FFPA_FAMILIES, "users": USER_FAMILIES, "all": ALL_FAMILIES,
                  "serving": SERVING_FAMILIES, "masks": MASK_FAMILIES}

FFPA_SEQLENS = (8192, 16384)
FFPA_HEAD_DIMS = (320, 384, 512, 576, 640, 768, 1024)
USER_SEQLENS = {"gemma4": (4096, 8192, 16384), "mqa": (4096, 8192, 16384),
                "mla": (4096, 8192, 16384), "mla-decode": (4096, 8192, 16384),
                "vae": (16384, 32768, 65536), "keypad": (4096, 8192), "images": (4096, 8192),
                "windowmask": (4096, 8192)}
MLA_DECODE_BATCH = 128
DTYPES = ("bf16", "fp16", "fp32", "fp8")  # fp8: e4m3 inputs (quantised per head), bf16 out
DEFAULT_DTYPE = "bf16"
CROSS_NQ = 1024


@dataclass(frozen=True)
class Case:
    """One benchmark problem. `causal` is bottom-right aligned (as ffpa_cute.attention). `dv`:
    V's head dim when it differs from D, V then being K's first dv columns (MLA's absorbed
    layout: `runner.make_inputs`)."""

    name: str
    dtype: str
    batch: int
    hq: int
    hkv: int
    nq: int
    nkv: int
    d: int
    causal: bool = False
    dv: int | None = None
    mask: str | None = None   # a MASK_FAMILIES kind: `attn_mask(case)` is the tensor

    @property
    def label(self) -> str:
        c = "c" if self.causal else "nc"
        dv = f"-dv{self.dv}" if self.dv is not None else ""
        m = f"-m{self.mask}" if self.mask else ""
        return (f"{self.name}-{self.dtype}-b{self.batch}-h{self.hq}x{self.hkv}"
                f"-n{self.nq}x{self.nkv}-d{self.d}{dv}-{c}{m}")

    @property
    def gqa(self) -> bool:
        return self.hq != self.hkv

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs of one head (with a mask: of the whole batch, over B)."""
        if self.mask:
            return kept_pairs(self) // self.batch
        return valid_pairs(self.nq, self.nkv, self.causal)

    def flops(self, direction: str) -> float:
        if self.mask:   # 4 Hq D per kept pair of the batch (Dv = D), backward 2.5x
            fwd = 4.0 * self.hq * kept_pairs(self) * self.d
            return fwd if direction == "fwd" else 2.5 * fwd
        fn = attn_flops_fwd if direction == "fwd" else attn_flops_bwd
        return fn(self.batch, self.hq, self.nq, self.nkv, self.d, self.causal,
                  head_dim_v=self.dv)

    def to_dict(self) -> dict:
        return asdict(self)


def _ffpa_case(family: str, n: int, d: int, dtype: str, batch: int = 1, heads: int = 32) -> Case:
    if family == "self":
        return Case(family, dtype, batch, heads, heads, n, n, d)
    if family == "cross":
        return Case(family, dtype, batch, heads, heads, min(CROSS_NQ, n), n, d)
    if family == "decode":
        return Case(family, dtype, batch, heads, heads, 1, n, d)
    if family == "gqa":
        return Case(family, dtype, batch, heads, max(1, heads // 4), n, n, d)
    if family == "causal":
        return Case(family, dtype, batch, heads, heads, n, n, d, causal=True)
    if family == "unaligned":
        return Case(family, dtype, batch, heads, heads, n - 1, n - 1, d)
    raise ValueError(f"unknown FFPA family {family!r}")


def _mask_case(family: str, n: int, dtype: str) -> Case:
    return Case(family, dtype, 4, 32, 32, n, n, 512, mask=family)


def keep(case: Case):
    """The kept (query, key) pairs of a mask case, bool [B or 1, 1, Nq or 1, Nkv] on the CPU."""
    import torch

    n, i = case.nkv, torch.arange(case.nkv)
    if case.mask == "keypad":
        lengths = torch.tensor([n * (8 - b % 8) // 8 for b in range(case.batch)])
        return (i[None] < lengths[:, None])[:, None, None]
    if case.mask == "images":
        lengths = i + 1
        for j in range(4):
            a = n // 16 + j * n // 4
            lengths[a:a + n // 16] = a + n // 16
        return (i[None] < lengths[:, None])[None, None]
    if case.mask == "windowmask":
        return ((i[None] <= i[:, None]) & (i[None] > i[:, None] - 128))[None, None]
    raise ValueError(f"unknown mask {case.mask!r}")


@functools.lru_cache(maxsize=64)
def kept_pairs(case: Case) -> int:
    """The (query, key) pairs a mask case keeps over its whole batch (one head)."""
    k = keep(case)
    per_row = k.sum(-1)   # [B or 1, 1, Nq or 1]
    return int(per_row.expand(case.batch, 1, case.nq).sum())


def attn_mask(case: Case, device):
    """The `attn_mask` tensor a mask case passes (as users pass it: keypad [B, 1, 1, N],
    images and windowmask [N, N])."""
    k = keep(case)
    return (k if case.mask == "keypad" else k[0, 0]).to(device)


def _user_case(family: str, n: int, dtype: str) -> Case:
    if family == "gemma4":
        return Case(family, dtype, 1, 32, 4, n, n, 512, causal=True)
    if family == "mqa":
        return Case(family, dtype, 1, 64, 1, n, n, 512, causal=True)
    if family == "mla":
        return Case(family, dtype, 1, 128, 1, n, n, 576, causal=True, dv=512)
    if family == "mla-decode":
        return Case(family, dtype, MLA_DECODE_BATCH, 128, 1, 1, n, 576, causal=True, dv=512)
    if family == "vae":
        return Case(family, dtype, 1, 1, 1, n, n, 512)
    raise ValueError(f"unknown user family {family!r}")


def parse_families(spec: str | None) -> tuple[str, ...]:
    """'self,gqa' / 'ffpa' / 'users' / 'all' / None -> ordered, deduplicated family names."""
    if not spec:
        return ALL_FAMILIES
    out: list[str] = []
    for tok in (t.strip().lower() for t in spec.split(",")):
        if not tok:
            continue
        names = FAMILY_ALIASES.get(tok, (tok,))
        for name in names:
            known = ALL_FAMILIES + SERVING_FAMILIES + MASK_FAMILIES
            if name not in known:
                raise ValueError(f"unknown case family {name!r}; choose from "
                                 f"{', '.join(known)}, or {', '.join(FAMILY_ALIASES)}")
            if name not in out:
                out.append(name)
    return tuple(out)


def parse_ints(spec: str | None) -> tuple[int, ...] | None:
    """'320,512' -> (320, 512); None/'' -> None. Accepts 8k / 16K."""
    if not spec:
        return None
    vals = []
    for tok in (t.strip().lower() for t in spec.split(",")):
        if not tok:
            continue
        mult = 1024 if tok.endswith("k") else 1
        vals.append(int(tok[:-1] if mult > 1 else tok) * mult)
    return tuple(vals)


def parse_dtypes(spec: str | None) -> tuple[str, ...] | None:
    if not spec:
        return None
    alias = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
             "float": "fp32"}
    out = []
    for tok in (t.strip().lower() for t in spec.split(",")):
        if not tok:
            continue
        tok = alias.get(tok, tok)
        if tok not in DTYPES:
            raise ValueError(f"unknown dtype {tok!r}; choose from {', '.join(DTYPES)}")
        if tok not in out:
            out.append(tok)
    return tuple(out)


def full_cases(families=ALL_FAMILIES, head_dims=None, seqlens=None, dtypes=None) -> list[Case]:
    """Every case of the selected families. `dtypes=None`: bf16, plus fp32 for the VAE."""
    cases: list[Case] = []
    hds = tuple(head_dims) if head_dims else FFPA_HEAD_DIMS
    for fam in families:
        if fam in SERVING_FAMILIES:
            continue  # perf/serving.py's
        if fam in MASK_FAMILIES:
            if head_dims and 512 not in head_dims:
                continue
            for dt in dtypes or (DEFAULT_DTYPE,):
                for n in seqlens or USER_SEQLENS[fam]:
                    cases.append(_mask_case(fam, n, dt))
        elif fam in FFPA_FAMILIES:
            for dt in dtypes or (DEFAULT_DTYPE,):
                for n in seqlens or FFPA_SEQLENS:
                    for d in hds:
                        cases.append(_ffpa_case(fam, n, d, dt))
        else:
            model = _user_case(fam, 1, DEFAULT_DTYPE)   # the family's head dims
            if head_dims and model.d not in head_dims and model.dv not in head_dims:
                continue
            fam_dtypes = dtypes or ((DEFAULT_DTYPE, "fp32") if fam == "vae" else (DEFAULT_DTYPE,))
            for dt in fam_dtypes:
                for n in seqlens or USER_SEQLENS[fam]:
                    cases.append(_user_case(fam, n, dt))
    return _dedup(cases)


def quick_cases(families=ALL_FAMILIES, head_dims=None, seqlens=None, dtypes=None) -> list[Case]:
    """A handful that runs in under two minutes: D=512 self/causal/GQA, D=320, D=1024 (N=8K).

    Selection flags filter this list (they never grow it).
    """
    n = 8192
    base = [_ffpa_case(fam, n, d, dt) for dt in (dtypes or (DEFAULT_DTYPE,))
            for fam, d in (("self", 512), ("self", 320), ("self", 1024), ("causal", 512),
                           ("gqa", 512))]
    out = []
    for c in base:
        if c.name not in families:
            continue
        if head_dims and c.d not in head_dims:
            continue
        if seqlens and c.nkv not in seqlens:
            continue
        if dtypes and c.dtype not in dtypes:
            continue
        out.append(c)
    return out


def select_cases(*, quick: bool = False, cases: str | None = None, head_dims: str | None = None,
                 seqlens: str | None = None, dtypes: str | None = None) -> list[Case]:
    """The CLI's case selection from its raw string arguments."""
    fams = parse_families(cases)
    if (head_dims or "").strip().lower() == "all":   # every multiple of 8 the kernels take
        from ffpa_cute.precompile import ALL_HEAD_DIMS as hds
    else:
        hds = parse_ints(head_dims)
    sls, dts = parse_ints(seqlens), parse_dtypes(dtypes)
    if quick:
        return quick_cases(fams, hds, sls, dts)
    return full_cases(fams, hds, sls, dts)


def _dedup(cases: list[Case]) -> list[Case]:
    seen, out = set(), []
    for c in cases:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out
