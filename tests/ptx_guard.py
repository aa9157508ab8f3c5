"""Which default kernels' generated code is the code that passed the GPU tests.

`tests/ptx_verified.json` maps a kernel config (by name) to the sha256 of its PTX and the
commit whose GPU run verified that exact code. `tests/test_ptx_guard.py` recompiles each on the
CPU and fails when the PTX differs: a kernel edit changed code the GPU has not run. After
running the GPU tests on the new code, refresh the record with

    CUTE_DSL_ARCH=sm_90a python -m tests.ptx_guard --verified-at <commit>

(or `--verified-at none` to record an edit as compile-verified only: the README must then say
so). Keeping this record exact is what lets a session say "byte-identical to the verified code".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re

from ffpa_cute.options import Options
from ffpa_cute.problem import AttnProblem

RECORD = pathlib.Path(__file__).with_name("ptx_verified.json")


def _problem(d, causal):
    return AttnProblem(dtype="bf16", batch=1, heads_q=2, heads_kv=1, seqlen_q=4096, seqlen_kv=4096,
                       head_dim=d, head_dim_v=d, causal=causal)


def kernels() -> dict:
    """name -> (kernel class, config): the default configs of every GPU-run kernel."""
    from ffpa_cute import dispatch
    from ffpa_cute.common.config import CombineConfig, DeltaConfig
    from ffpa_cute.sm80 import config as sm80_config
    from ffpa_cute.sm90 import config as sm90_config
    from ffpa_cute.sm90 import fused_config as sm90_fused

    import dataclasses

    out = {}
    # (520, 576: O in one CTA above 512, `wide_o`)
    for d, causal in ((320, False), (512, True), (1024, False), (520, False), (576, False)):
        plan = dispatch.plan_fwd(_problem(d, causal), target="sm_90a", opts=Options())
        out[f"sm90-fwd-d{d}-{'causal' if causal else 'full'}"] = (plan.kernel_cls, plan.cfg)
    for d, causal in ((512, False), (512, True), (320, False)):  # the FP8 forward, serial, or
        p = dataclasses.replace(_problem(d, causal), dtype="e4m3", out_dtype="bf16")  # (D=320
        plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())  # full) `overlap`
        out[f"sm90-fp8-fwd-d{d}-{'causal' if causal else 'full'}"] = (plan.kernel_cls, plan.cfg)
    cfg = sm80_config.plan_fwd(_problem(512, True), "sm_90a")  # the Split-D forward on sm_90a
    out["splitd-fwd-d512-causal-sm90a"] = (dispatch.kernel_class(cfg), cfg)
    for d, causal in ((512, True), (1024, False)):  # the Split-D FP8 forward (M4N2, M2N4)
        p = dataclasses.replace(_problem(d, causal), dtype="e4m3", out_dtype="bf16")
        cfg = sm80_config.plan_fwd(p, "sm_90a")
        out[f"splitd-fp8-fwd-d{d}-{'causal' if causal else 'full'}-sm90a"] = (
            dispatch.kernel_class(cfg), cfg)
    for d in (512, 1024):
        p = _problem(d, True)  # at 1024 the gradient on a CTA pair; G = 2: dK / dV split groups
        for name, plan in (("dq", sm90_config.plan_dq), ("dk", sm90_config.plan_dk),
                           ("dv", sm90_config.plan_dv)):
            if d == 1024 and name == "dv":
                continue
            cfg = plan(p)
            out[f"sm90-bwd-{name}-d{d}-causal"] = (dispatch.kernel_class(cfg), cfg)
    for d in (512, 576):  # the fused backward, the default (at 576 288 columns a CTA)
        cfg = sm90_fused.plan_bwd_fused(_problem(d, True))
        out[f"sm90-bwd-fused-d{d}-causal"] = (dispatch.kernel_class(cfg), cfg)
    for d in (320, 512, 576):  # causal MQA 64:1 by row units (`row_units`)
        cfg = sm90_fused.plan_bwd_fused(dataclasses.replace(_problem(d, True), heads_q=64))
        assert cfg.row_units
        out[f"sm90-bwd-fused-d{d}-mqa-causal-row-units"] = (dispatch.kernel_class(cfg), cfg)
    for kind in ("dq", "dv"):
        cfg = sm80_config.plan_bwd(kind, _problem(1024, True), "sm_90a")
        out[f"splitd-bwd-{kind}-d1024-causal-sm90a"] = (dispatch.kernel_class(cfg), cfg)
    cfg = DeltaConfig("sm_90a", "bf16", 512)
    out["delta-d512-sm90a"] = (dispatch.kernel_class(cfg), cfg)
    cfg = CombineConfig("sm_90a", "bf16", 512)  # the decode's split combine
    out["combine-dv512-sm90a"] = (dispatch.kernel_class(cfg), cfg)
    # the framework features: a window's left edge, sinks, the decode

    p = dataclasses.replace(_problem(512, True), window_lo=-1024, has_sinks=True)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    out["sm90-fwd-d512-window-sinks"] = (plan.kernel_cls, plan.cfg)
    cfg = sm90_config.plan_dk(p)
    out["sm90-bwd-dk-d512-window"] = (dispatch.kernel_class(cfg), cfg)
    p = AttnProblem(dtype="bf16", batch=1, heads_q=4, heads_kv=4, seqlen_q=8, seqlen_kv=4096,
                    head_dim=512, head_dim_v=512)
    plan = dispatch.plan_decode(p, 64, target="sm_90a", opts=Options())
    out["sm90-decode-d512-page64"] = (plan.kernel_cls, plan.cfg)
    plan = dispatch.plan_decode(p, 64, target="sm_90a", opts=Options(), kv_dtype="e4m3")
    out["sm90-decode-keys-d512-page64-e4m3-cache"] = (plan.kernel_cls, plan.cfg)
    # > 32 rows per KV head: the row-tiled kernel on an FP8 cache
    plan = dispatch.plan_decode(dataclasses.replace(p, seqlen_q=64), 64, target="sm_90a",
                                opts=Options(), kv_dtype="e4m3")
    out["sm90-decode-d512-page64-e4m3-cache"] = (plan.kernel_cls, plan.cfg)
    plan = dispatch.plan_decode(dataclasses.replace(p, causal=True), 64, target="sm_90a",
                                opts=Options())
    out["sm90-decode-d512-page64-chunked-prefill"] = (plan.kernel_cls, plan.cfg)
    p = dataclasses.replace(_problem(512, True), varlen=True)  # one launch over sequences
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    out["sm90-fwd-d512-varlen"] = (plan.kernel_cls, plan.cfg)
    cfg = sm90_config.plan_dk(p)
    out["sm90-bwd-dk-d512-varlen"] = (dispatch.kernel_class(cfg), cfg)
    cfg = sm90_config.plan_dk(_problem(520, True))  # D % 16 == 8 on the CTA pair
    out["sm90-bwd-dk-d520-causal"] = (dispatch.kernel_class(cfg), cfg)
    p = dataclasses.replace(_problem(512, True), heads_q=1)  # MHA: whole head groups
    for name, plan in (("dk", sm90_config.plan_dk), ("dv", sm90_config.plan_dv)):
        cfg = plan(p)
        assert not cfg.group_split
        out[f"sm90-bwd-{name}-d512-causal-mha"] = (dispatch.kernel_class(cfg), cfg)
    p = dataclasses.replace(_problem(512, True), heads_q=64, seqlen_kv=1024)  # MQA: split
    cfg = sm90_config.plan_dv(p)                                             # head groups
    assert cfg.group_split
    out["sm90-bwd-dv-d512-mqa-group-split"] = (dispatch.kernel_class(cfg), cfg)
    p = dataclasses.replace(_problem(520, True), window_lo=-200, has_sinks=True)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options(family="sm80"))  # Split-D
    out["splitd-fwd-d520-window-sinks-sm90a"] = (plan.kernel_cls, plan.cfg)
    cfg = sm80_config.plan_bwd("dk", p, "sm_90a")
    out["splitd-bwd-dk-d520-window-sm90a"] = (dispatch.kernel_class(cfg), cfg)
    p = dataclasses.replace(_problem(512, True), varlen=True)  # Split-D, one launch
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options(family="sm80"))
    out["splitd-fwd-d512-varlen-sm90a"] = (plan.kernel_cls, plan.cfg)
    cfg = sm80_config.plan_bwd("dk", p, "sm_90a")
    out["splitd-bwd-dk-d512-varlen-sm90a"] = (dispatch.kernel_class(cfg), cfg)
    return out


def normalized_ptx(ptx: str) -> str:
    """The PTX with its kernel's symbol name replaced by "kernel": cutlass-dsl mangles the
    module path, class name and argument layouts into the name, so moving or renaming a kernel
    class changes the text but not the code. Everything else (instructions, parameter types,
    registers, shared memory) is compared as generated."""
    names = set(re.findall(r"\.entry\s+([A-Za-z_$][\w$]*)", ptx))
    for name in sorted(names, key=len, reverse=True):
        ptx = ptx.replace(name, "kernel")
    return ptx


def ptx_sha(cls, cfg) -> str:
    ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
    return hashlib.sha256(normalized_ptx(ptx).encode()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verified-at", required=True,
                    help="commit whose GPU run tested this code, or 'none'")
    a = ap.parse_args(argv)
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for name, (cls, cfg) in kernels().items():
        sha = ptx_sha(cls, cfg)
        if record.get(name, {}).get("sha256") != sha:
            record[name] = {"sha256": sha, "config": repr(cfg),
                            "verified_at": None if a.verified_at == "none" else a.verified_at}
            print(f"{name}: recorded ({a.verified_at})")
        elif record[name]["config"] != repr(cfg):  # a new config field, the same code
            record[name]["config"] = repr(cfg)
            print(f"{name}: config text updated (same PTX)")
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
