"""V read from K's ring when v is k's prefix (`shared_kv`, sm90; DeepSeek's absorbed MLA has
V = K[..., :512] with Dqk 576): detection, planning, the ring's protocol model and the compiled
kernel on CPU; numerics against float64 on the GPU (@gpu)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from ffpa_cute import dispatch
from ffpa_cute.common.protocol import ProtocolError
from ffpa_cute.options import Options
from ffpa_cute.problem import AttnProblem, kv_shared
from ffpa_cute.sm90 import config as c90
from ffpa_cute.sm90 import fwd_protocol

# (D, Dv): MLA's, `v is k` at 512 and 384, and Dv < D with whole 128-column halves
SHARED = ((576, 512), (512, 512), (384, 384), (512, 256))


def _problem(d, dv, causal=False, hq=4, hkv=1, shared=True, **kw):
    return AttnProblem(dtype="bf16", batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=129,
                       seqlen_kv=1000, head_dim=d, head_dim_v=dv, causal=causal,
                       shared_kv=shared, **kw)


def _shared_cfg(d, dv, causal=False, **kw):
    p = _problem(d, dv, causal, **kw)
    return c90.shared_kv_config(c90.plan_fwd(p, "sm_90a"))


def test_detects_prefix_views():
    """v is k, or k[..., :Dv] (a view at k's first element with k's strides), under any leading
    dims; copies, other offsets and other strides are not shared."""
    k = torch.randn(2, 3, 5, 576)
    assert kv_shared(k, k) and kv_shared(k, k[..., :512]) and kv_shared(k[0], k[0, ..., :256])
    assert not kv_shared(k, k[..., 64:])
    assert not kv_shared(k, k[..., :512].clone())
    assert not kv_shared(k, k.transpose(1, 2)[..., :512])
    assert not kv_shared(k, k[:, :, :4, :512])     # fewer rows
    assert not kv_shared(k, k.to(torch.float64)[..., :512])
    p = AttnProblem.from_tensors(k[:1], k[:1], k[:1, ..., :512])
    assert p.shared_kv and p.head_dim_v == 512
    assert not AttnProblem.from_tensors(k, k, k[..., :512].clone()).shared_kv


def test_fast_path_key_tells_shared_from_not():
    """The per-signature fast path must not reuse a shared plan for a v that only has the same
    shapes and strides: whether v is k's prefix is in the key."""
    from ffpa_cute import interface

    k = torch.randn(1, 1, 8, 576)
    q = torch.randn(1, 4, 8, 576)
    shared = k[..., :512]
    other = torch.randn(1, 1, 8, 576)[..., :512]
    key = [interface._fast_key(q, k, v, None, 0.0, False, None, True, False)
           for v in (shared, other)]
    assert shared.stride() == other.stride() and key[0] != key[1]


@pytest.mark.parametrize("d,dv", SHARED)
def test_config_and_planner(d, dv, monkeypatch):
    """`shared_kv_config`: tile_n 64, Q resident, K ring of two blocks' V chunks and one block's
    others, no V rings, within sm_90a's shared memory; planned only with SHARED_KV on, for a
    problem whose v is k's prefix, and never for the gradients or under FP8."""
    cfg = _shared_cfg(d, dv)
    assert c90.can_implement(cfg) is None
    assert (cfg.tile_n, cfg.v_stages, cfg.stream_q, cfg.persistent) == (64, 0, False, False)
    assert cfg.k_stages == cfg.num_k_chunks + dv // 64 and cfg.v_rows == 64
    assert cfg.smem_bytes() <= c90.SMEM_CAPACITY
    p = _problem(d, dv, True)
    assert not dispatch.plan_fwd(p, target="sm_90a").cfg.shared_kv   # off by default
    monkeypatch.setattr(c90, "SHARED_KV", True)
    dispatch._plan_fwd.cache_clear()
    try:
        assert dispatch.plan_fwd(p, target="sm_90a").cfg.shared_kv
        assert not dispatch.plan_fwd(dataclasses.replace(p, shared_kv=False),
                                     target="sm_90a").cfg.shared_kv
        bwd = dispatch.plan_bwd(dataclasses.replace(p, requires_grad=True), target="sm_90a",
                                opts=Options(family="sm90"))
        assert bwd.reason is None and not any(getattr(c, "shared_kv", False) for c in bwd.cfgs)
    finally:
        dispatch._plan_fwd.cache_clear()


def test_rejections():
    """What shared_kv cannot do is refused with its reason: Dv not whole 128-column halves,
    another tile_n, streamed Q, V rings, a ring of the wrong depth, FP8."""
    cfg = _shared_cfg(576, 512)
    for bad in (dataclasses.replace(cfg, head_dim_v=448, k_stages=16),
                dataclasses.replace(cfg, tile_n=128), dataclasses.replace(cfg, stream_q=True),
                dataclasses.replace(cfg, persistent=True)):
        assert "shared_kv needs" in c90.can_implement(bad)
    for bad in (dataclasses.replace(cfg, v_stages=2), dataclasses.replace(cfg, k_stages=16)):
        assert "k_stages 17" in c90.can_implement(bad)
    assert c90.SMEM_CAPACITY < dataclasses.replace(cfg, head_dim=704).smem_bytes()
    fp8 = c90.FwdFP8ConfigSm90(**{**dataclasses.asdict(cfg), "dtype": "e4m3",
                                  "head_dim_v": None, "head_dim": 512, "k_stages": 12,
                                  "half_align": 8})
    assert "shared_kv needs" in c90.can_implement(fp8)


@pytest.mark.parametrize("d,dv", SHARED)
@pytest.mark.parametrize("publish_after", [0, 3, None])
def test_protocol_model_runs_clean(d, dv, publish_after):
    """The executable model of the ring (sm90/fwd_protocol.py: the three warpgroups, TMA landing
    in any order, WGMMAs reading until their wait_group, V chunks refilled by their O
    warpgroup) finishes without a hang or a hazard for 0-8 blocks, many interleavings, P handed
    over before, during or after QK[i+1]."""
    cfg = _shared_cfg(d, dv)
    pa = cfg.num_k_chunks if publish_after is None else publish_after
    cfg = dataclasses.replace(cfg, publish_after=pa)
    for blocks in (0, 1, 2, 3, 5, 8):
        for seed in range(15):
            fwd_protocol.run(cfg, blocks, seed)


@pytest.mark.parametrize("fault,message", [
    ("s_refills_v", "waiting for phase"),           # the plain ring's refill: too early
    ("refill_before_wait", "writes"),               # a V chunk refilled under its PV
    ("skip_slot", "arrivals")])                      # one block slot for every block
def test_protocol_model_catches_faults(fault, message):
    cfg = _shared_cfg(576, 512)
    with pytest.raises(ProtocolError, match=message):
        for seed in range(20):
            fwd_protocol.run(cfg, 6, seed, faults=(fault,))


@pytest.mark.parametrize("d,dv,causal", [(576, 512, True), (576, 512, False), (512, 512, True),
                                         (384, 384, False)])
def test_compiles(tmp_path, monkeypatch, d, dv, causal):
    """The kernel builds for sm_90a without spills: m64n64 score WGMMAs and m64n(Dv / 2) PV
    WGMMAs, fed by TMA."""
    from test_kernels_compile import _no_spills

    monkeypatch.chdir(tmp_path)
    cfg = _shared_cfg(d, dv, causal)
    cls = dispatch.kernel_class(cfg)
    ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16", ptx)
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{dv // 2}k16", ptx)
    assert "cp.async.bulk.tensor" in ptx
    _no_spills(ptx)


# ------------------------------------------------------------------------------- GPU
GPU_CASES = [  # (D, Dv, Hq, Hkv, Nq, Nkv, mode)
    (576, 512, 16, 1, 129, 1000, "bottom_right"), (576, 512, 8, 1, 1000, 129, "upper_left"),
    (576, 512, 4, 1, 7, 7, "none"), (576, 512, 2, 2, 1, 4097, "none"),
    (512, 512, 4, 4, 1000, 1000, "bottom_right"), (384, 384, 4, 2, 129, 1000, "none"),
    (512, 256, 8, 1, 129, 1000, "bottom_right")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_shared_kv_forward(seed, monkeypatch, case):
    """With SHARED_KV on, v = k[..., :Dv] (or v is k) runs the shared_kv kernel through the
    public API; out within 2x torch's same-dtype error + 1e-3 of float64 and the LSE within
    2e-3, odd lengths, GQA / MQA, both causal alignments."""
    from torch.nn.attention.bias import causal_upper_left

    from ffpa_cute import attention, interface
    from ffpa_cute.reference import attention_ref, attention_same_dtype, rel_err

    if dispatch.current_arch() != "sm_90a":
        pytest.skip("shared_kv is an sm90 kernel")
    d, dv, hq, hkv, nq, nkv, mode = case
    monkeypatch.setattr(c90, "SHARED_KV", True)
    dispatch._plan_fwd.cache_clear()
    interface._FAST_CALLS.clear()
    try:
        q = torch.randn(1, hq, nq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, hkv, nkv, d, device="cuda", dtype=torch.bfloat16)
        v = k if dv == d else k[..., :dv]
        causal = mode != "none"
        off = nkv - nq if mode == "bottom_right" else 0
        p = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=off)
        assert p.shared_kv and dispatch.plan_fwd(p).cfg.shared_kv
        mask = causal_upper_left(nq, nkv) if mode == "upper_left" else None
        out, lse = attention(q, k, v, attn_mask=mask, is_causal=mode == "bottom_right",
                             enable_gqa=hq != hkv, strict=True, return_lse=True)
        ref, ref_lse = attention_ref(q, k, v, causal=causal, causal_offset=off)
        base, _ = attention_same_dtype(q, k, v, causal=causal, causal_offset=off)
        err, base_err = rel_err(out, ref), rel_err(base, ref)
        assert err <= 2 * base_err + 1e-3, f"err {err:.3g} vs torch {base_err:.3g}"
        finite = torch.isfinite(ref_lse)
        assert (lse[finite].double() - ref_lse[finite]).abs().max().item() <= 2e-3
        # the same signature with an unshared v of equal values takes the planned kernel
        out2 = attention(q, k, v.clone(), attn_mask=mask, is_causal=mode == "bottom_right",
                         enable_gqa=hq != hkv, strict=True)
        assert rel_err(out2, ref) <= 2 * base_err + 1e-3
    finally:
        dispatch._plan_fwd.cache_clear()
        interface._FAST_CALLS.clear()
