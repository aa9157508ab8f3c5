"""The sm90 backward kernels on a GPU (every test is @gpu; sm_90 only).

dV, dQ and dK (`ffpa_cute/sm90/bwd_sm90.py`) against float64 with the forward's criterion:
rel_err(kernel) <= 2 * rel_err(same-dtype torch) + 1e-3. The LSE (and O for Delta) they consume
come from our own forward, as in training. The dQ / dK reference is written out
(`reference.attention_grads`, not autograd): rows that see no key make autograd's softmax
gradient NaN.
"""

import dataclasses

import pytest
import torch

import kernels  # tests/ is on sys.path
from ffpa_cute import dispatch
from ffpa_cute.problem import AttnProblem
from ffpa_cute.reference import attention_grads, rel_err

pytestmark = pytest.mark.gpu

CASES = [(512, False, 1000, 1000, 1), (512, True, 129, 1000, 4), (320, True, 1000, 129, 1),
         (384, False, 7, 300, 16), (448, True, 4097, 4097, 1), (264, False, 1, 129, 4),
         (512, True, 1000, 1000, 8)]


def _inputs(d, causal, nq, nkv, ratio, dt=torch.bfloat16, dv=None):
    """q, k, v, dO (2 KV heads, `ratio` query heads each; v and dO `dv` wide when given), the
    problem, and the sm90 forward's out and lse (bottom-right causal offset)."""
    if dispatch.current_arch() != "sm_90a":
        pytest.skip("WGMMA kernels: sm_90 only")
    hkv, dv = 2, dv or d
    q, k, v, do = (torch.randn(1, h, n, w, device="cuda", dtype=dt)
                   for h, n, w in ((hkv * ratio, nq, d), (hkv, nkv, d), (hkv, nkv, dv),
                                   (hkv * ratio, nq, dv)))
    problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=nkv - nq)
    out, lse = kernels.forward(problem, q, k, v, "sm90")
    return q, k, v, do, problem, out, lse


def _check(d, causal, nq, nkv, ratio, want, dt=torch.bfloat16, dv=None, plan=None):
    """The sm90 backward kernels' `want` gradients ("dq", "dk", "dv") against float64 (written
    out, `reference.attention_grads`), the forward's criterion. `plan`: the backward plan to run,
    or a function of the problem returning it (default: the routed sm90 plan)."""
    q, k, v, do, problem, out, lse = _inputs(d, causal, nq, nkv, ratio, dt, dv)
    if callable(plan):   # a planner of the problem
        plan = plan(problem)
    if plan is None:
        plan = kernels.backward_plan(problem, q.device, "sm90")
        assert [c.__name__ for c, _ in plan.jobs][1:] == [
            "FFPABwdDQSm90", "FFPABwdDKSm90", "FFPABwdDVSm90"]
    got = kernels.backward(problem, q, k, v, out, lse, do, "sm90", plan=plan)
    torch.cuda.synchronize()
    off = problem.causal_offset
    ref = attention_grads(q, k, v, do, causal, off, dtype=torch.float64)
    base = attention_grads(q, k, v, do, causal, off, dtype=dt)
    for name, x, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        if name in want:
            assert x.shape == r.shape and x.dtype == dt
            err, base_err = rel_err(x, r), rel_err(b, r)
            assert err <= 2 * base_err + 1e-3, f"{name} err {err:.3g} vs torch {base_err:.3g}"
    return got


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", CASES)
def test_dv_matches_reference(seed, d, causal, nq, nkv, ratio):
    """dV summed over each KV head's query heads (GQA ratio `ratio`) inside the kernel."""
    _check(d, causal, nq, nkv, ratio, ("dv",))


@pytest.mark.parametrize("want", ["dq", "dk"])
@pytest.mark.parametrize("d,causal,nq,nkv,ratio", CASES)
def test_dq_dk_match_reference(seed, d, causal, nq, nkv, ratio, want):
    _check(d, causal, nq, nkv, ratio, (want,))


def test_same_bits_every_run(seed):
    """Atomic-free (GQA sums in registers, fixed order): two runs give the same bits."""
    q, k, v, do, problem, out, lse = _inputs(512, True, 129, 1000, 4)
    a = kernels.backward(problem, q, k, v, out, lse, do, "sm90")
    b = kernels.backward(problem, q, k, v, out, lse, do, "sm90")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [(584, True, 129, 1000, 4),
                                                   (1024, False, 300, 129, 1),
                                                   (768, True, 1000, 1000, 2)])
def test_kv_pair_is_the_recomputing_pair(seed, d, causal, nq, nkv, ratio):
    """Above 576 the CTA pair splits the column blocks and exchanges P / dS (`kv_pair`, the
    default) instead of both CTAs scoring every block: each tile a CTA gets from its peer is
    the one it would have computed, added in the same order, so dQ, dK and dV are the same
    bits as with `Options(kv_pair=False)` (test_above_512 checks the default against
    float64)."""
    from ffpa_cute.options import Options

    q, k, v, do, problem, out, lse = _inputs(d, causal, nq, nkv, ratio)
    plan = kernels.backward_plan(problem, q.device, "sm90")
    assert all(c.kv_pair for c in plan.cfgs[1:])
    off = dispatch.plan_bwd(problem, q.device, opts=Options(family="sm90", kv_pair=False))
    assert not any(getattr(c, "kv_pair", False) for c in off.cfgs)
    paired = kernels.backward(problem, q, k, v, out, lse, do, "sm90", plan=plan)
    alone = kernels.backward(problem, q, k, v, out, lse, do, "sm90", plan=off)
    for name, x, y in zip(("dq", "dk", "dv"), paired, alone):
        assert torch.equal(x, y), (name, (x.float() - y.float()).abs().max())


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [(512, True, 1000, 1000, 8),
                                                   (1024, True, 129, 700, 4),
                                                   (576, False, 300, 129, 16)])
def test_group_split(seed, d, causal, nq, nkv, ratio):
    """dK / dV with the head group split over CTAs (`group_split`: fp32 partial sums in a
    workspace, added up on the host) against the same kernels summing the whole group in one
    CTA, on the same inputs: both within the float64 bound, equal up to the fp32 order of the
    sum, and the split one the same bits on a second run."""
    q, k, v, do, problem, out, lse = _inputs(d, causal, nq, nkv, ratio)
    plan = kernels.backward_plan(problem, q.device, "sm90")
    assert any(getattr(c, "group_split", False) for c in plan.cfgs)
    whole = dataclasses.replace(plan, cfgs=tuple(
        dataclasses.replace(c, group_split=False) if hasattr(c, "group_split") else c
        for c in plan.cfgs))
    split = kernels.backward(problem, q, k, v, out, lse, do, "sm90", plan=plan)
    again = kernels.backward(problem, q, k, v, out, lse, do, "sm90", plan=plan)
    one = kernels.backward(problem, q, k, v, out, lse, do, "sm90", plan=whole)
    off = problem.causal_offset
    ref = attention_grads(q, k, v, do, causal, off, dtype=torch.float64)
    base = attention_grads(q, k, v, do, causal, off, dtype=torch.bfloat16)
    for i in (1, 2):  # dK, dV
        assert torch.equal(split[i], again[i])
        assert rel_err(split[i], one[i]) <= 2e-3
        for x in (split[i], one[i]):
            assert rel_err(x, ref[i]) <= 2 * rel_err(base[i], ref[i]) + 1e-3


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [CASES[1], CASES[2], CASES[4], CASES[5]])
def test_dk_without_seq_scores(seed, d, causal, nq, nkv, ratio):
    """dK without `seq_scores` (64-query blocks, S^T and dP^T in two accumulators: what D > 512
    runs; below, the default is with), same checks."""
    from ffpa_cute.sm90 import config

    if dispatch.current_arch() != "sm_90a":
        pytest.skip("WGMMA kernels: sm_90 only")
    problem = AttnProblem(dtype="bf16", batch=1, heads_q=2 * ratio, heads_kv=2, seqlen_q=nq,
                          seqlen_kv=nkv, head_dim=d, head_dim_v=d, causal=causal,
                          causal_offset=nkv - nq)
    plan = kernels.backward_plan(problem, torch.device("cuda"), "sm90")
    dk = config.plan_dk(problem, seq_scores=False)
    assert dk.tile_n == 64 and not dk.seq_scores
    plan = dataclasses.replace(plan, cfgs=(plan.cfgs[0], plan.cfgs[1], dk, plan.cfgs[3]))
    _check(d, causal, nq, nkv, ratio, ("dk",), plan=plan)


# the hi share from a 128-byte line (`line_shares_bwd`, planned): D % 128 != 0 up to 512,
# causal both alignments, GQA with split head groups (ratio 8 over few KV tiles), fp16
LINE_CASES = [(320, True, 1000, 129, 1, torch.bfloat16), (264, False, 1, 129, 4, torch.bfloat16),
              (448, True, 4097, 4097, 1, torch.bfloat16), (400, False, 7, 300, 16, torch.float16),
              (336, True, 129, 1000, 8, torch.bfloat16), (272, False, 1000, 1000, 1, torch.float16)]


@pytest.mark.parametrize("d,causal,nq,nkv,ratio,dt", LINE_CASES)
def test_line_shares(seed, d, causal, nq, nkv, ratio, dt):
    """dQ, dK, dV as planned, each share from a 128-byte line (`sm90_config.line_shares_bwd`:
    the padding in the hi share), against float64, and the same bits as even shares
    (`plan_bwd(lines=False)`: each column is the same sum of products whichever warpgroup
    computes it)."""
    from ffpa_cute.sm90 import config as sm90_config

    def even(problem):
        planned = kernels.backward_plan(problem, torch.device("cuda"), "sm90")
        assert [c.split_align for c in planned.cfgs[1:]] == [64, 64, 64]
        cfgs = sm90_config.plan_bwd(problem, planned.cfgs[1].arch, lines=False)
        assert [c.split_align for c in cfgs] == [8, 8, 8]
        return dataclasses.replace(planned, cfgs=(planned.cfgs[0], *cfgs))

    got = _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), dt)
    q, k, v, do, problem, out, lse = _inputs(d, causal, nq, nkv, ratio, dt)
    lines = kernels.backward(problem, q, k, v, out, lse, do, "sm90")
    evens = kernels.backward(problem, q, k, v, out, lse, do, "sm90", plan=even(problem))
    for x, y in zip(lines, evens):
        assert torch.equal(x, y)
    assert all(x.shape == y.shape for x, y in zip(got, evens))


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [(512, True, 129, 1000, 4),
                                                   (320, False, 1000, 1000, 16),
                                                   (384, True, 1000, 129, 1)])
def test_fp16(seed, d, causal, nq, nkv, ratio):
    """fp16 inputs (dS goes to fp16 before the gradient GEMM): same criterion."""
    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), torch.float16)


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [(1024, True, 129, 1000, 4),
                                                   (768, False, 1000, 1000, 1),
                                                   (576, True, 1000, 129, 16),
                                                   (520, True, 700, 1000, 2),
                                                   (712, False, 300, 129, 1)])
def test_above_512(seed, d, causal, nq, nkv, ratio):
    """D > 512: up to 576 the gradient in one CTA (`wide_o`), above it split over a CTA pair
    that splits the score blocks, as the forward splits O; D % 16 == 8 (520, 712), at 712 with
    the second CTA's last 8 columns past D."""
    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"))


WIDE_BWD_CASES = [(576, True, 129, 1000, 4, torch.bfloat16), (520, False, 1000, 129, 1, torch.bfloat16),
                  (552, True, 700, 1000, 16, torch.float16), (544, True, 1000, 1000, 2, torch.bfloat16)]


@pytest.mark.parametrize("d,causal,nq,nkv,ratio,dt", WIDE_BWD_CASES)
def test_wide_gradient_kernels(seed, d, causal, nq, nkv, ratio, dt):
    """The dQ, dK and dV kernels with their gradient in one CTA from 520 to 576 (`wide_o`, as
    planned: `config.WIDE_BWD`): float64 criterion, both share widths (256 + 288 at 520, 288 +
    288 at 576), GQA 2-16, fp16."""

    def plan(problem):
        wide = kernels.backward_plan(problem, torch.device("cuda"), "sm90")
        assert all(c.wide_o and c.o_split == 1 for c in wide.cfgs[1:])
        return wide

    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), dt=dt, plan=plan)


@pytest.mark.parametrize("d,dv,causal,nq,nkv,ratio", [(576, 512, True, 129, 1000, 16),
                                                      (576, 512, False, 1000, 1000, 1),
                                                      (512, 320, True, 1000, 129, 4)])
def test_dv_not_d(seed, d, dv, causal, nq, nkv, ratio):
    """Dv != D (MLA-absorbed 576 / 512): dQ / dK with the second score product over Dv, dV
    accumulating Dv columns."""
    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), dv=dv)


def _fused_plan(problem, pad=None, **fields):
    """The fused backward (planned here, whatever the options; `pad`: `plan_bwd_fused`'s;
    `fields` change its config, the staging buffers refitted unless they name them), after
    the Delta kernel."""
    from ffpa_cute.common.config import DeltaConfig
    from ffpa_cute.sm90.fused_config import fit_dq_staging, plan_bwd_fused

    cfg = dataclasses.replace(plan_bwd_fused(problem, pad=pad), **fields)
    if "dq_buffers" not in fields:
        cfg = fit_dq_staging(cfg)
    return dispatch.BwdPlan(problem, "sm_90a", "sm90", cfgs=(
        DeltaConfig("sm_90a", problem.dtype, problem.head_dim_v), cfg))


FUSED_CASES = [(512, False, 1000, 1000, 1), (512, True, 129, 1000, 4), (320, True, 1000, 129, 1),
               (384, False, 7, 300, 16), (448, True, 4097, 4097, 1), (320, False, 1, 129, 4),
               (512, True, 1000, 1000, 8), (384, True, 64, 64, 2),
               # D=576 over the pair (`wide`: 288 columns a CTA, one Q and one dO stage)
               (576, True, 129, 1000, 4), (576, False, 1000, 1000, 1), (576, True, 1000, 129, 8)]


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", FUSED_CASES)
def test_fused_matches_reference(seed, d, causal, nq, nkv, ratio):
    """The fused backward (sm90/bwd_fused_sm90.py: one pass, a CTA pair per key tile splitting
    D, partial scores exchanged, dQ reduced in fp32): all three gradients against float64."""
    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), plan=_fused_plan)


@pytest.mark.parametrize("d,causal,nq,nkv,ratio,dt", [
    (336, True, 129, 1000, 4, torch.bfloat16), (520, False, 1000, 1000, 1, torch.bfloat16),
    (264, True, 1000, 129, 8, torch.float16), (472, True, 700, 700, 2, torch.bfloat16)])
def test_fused_padded(seed, d, causal, nq, nkv, ratio, dt):
    """D % 64 != 0 on the fused kernel at the next multiple of 64 (`plan_bwd_fused(pad=True)`:
    q, k, v and dout zero-padded by `launch.run_bwd`, the extra columns' gradients dropped):
    all three gradients against float64."""
    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), dt=dt,
           plan=lambda p: _fused_plan(p, pad=True))


# the default route: the fused kernel at D 264-576 (D % 64 != 0 on operands zero-padded to the
# next multiple of 64; groups up to 64, above by row units when causal), else the atomic-free
# kernels (D > 576)
DEFAULT_CASES = [(512, True, 129, 1000, 4, torch.bfloat16),
                 (320, False, 1000, 1000, 1, torch.float16),
                 (448, True, 1000, 129, 64, torch.bfloat16),
                 (384, False, 7, 300, 2, torch.bfloat16),
                 (336, True, 700, 1000, 4, torch.bfloat16),
                 (576, True, 129, 1000, 2, torch.bfloat16),
                 (576, False, 700, 1000, 4, torch.float16),
                 (512, True, 300, 300, 128, torch.bfloat16),
                 (384, True, 700, 1000, 16, torch.float16)]


@pytest.mark.parametrize("d,causal,nq,nkv,ratio,dt", DEFAULT_CASES)
def test_default_route(seed, d, causal, nq, nkv, ratio, dt):
    """The backward as a call plans it by default (`Options.deterministic` False: the fused
    kernel where `fused_pays` and it builds, else the atomic-free kernels): all three
    gradients against float64; the atomic-free grid above runs with `deterministic`."""
    from ffpa_cute.options import Options

    def plan(problem):
        routed = dispatch.plan_bwd(problem, torch.device("cuda"), opts=Options(family="sm90"))
        fused = 264 <= d <= 576 and (ratio <= 64 or causal)
        assert (routed.jobs[1][0].__name__ == "FFPABwdFusedSm90") == fused, routed.jobs
        return routed

    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), dt=dt, plan=plan)


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [(512, True, 1000, 1000, 4),
                                                   (320, False, 4097, 4097, 1)])
def test_default_route_run_to_run(seed, d, causal, nq, nkv, ratio):
    """The default (fused) backward three times on the same inputs: dK and dV the same bits
    (summed in registers in a fixed order); dQ, summed by fp32 reductions in whatever order
    they land, differs in few elements and by far less than its error against float64 (an
    element whose fp32 sum cancels can move by many of its own ulps; perf.bwd_fused
    --variation measures it at N=8K)."""
    from ffpa_cute.options import Options

    q, k, v, do, problem, out, lse = _inputs(d, causal, nq, nkv, ratio)
    plan = dispatch.plan_bwd(problem, q.device, opts=Options(family="sm90"))
    assert plan.jobs[1][0].__name__ == "FFPABwdFusedSm90"
    runs = [kernels.backward(problem, q, k, v, out, lse, do, "sm90", plan=plan)
            for _ in range(3)]
    ref = attention_grads(q, k, v, do, causal, problem.causal_offset, dtype=torch.float64)[0]
    for other in runs[1:]:
        assert torch.equal(runs[0][1], other[1]) and torch.equal(runs[0][2], other[2])
        a, b = runs[0][0], other[0]
        assert (a != b).float().mean() < 1e-2
        assert rel_err(a, b.double()) <= 0.1 * rel_err(a, ref)


# row units (`row_units`; planned for causal groups of 16+): bottom-right causal with Nq < Nkv
# and Nq > Nkv (rows that see no key), D=576 (`wide`), D % 64 != 0 padded, fp16, an odd length,
# and where the planner would not take them (G = 8, no causal mask, G = 2)
ROW_UNIT_CASES = [(512, True, 129, 1000, 32, torch.bfloat16),
                  (320, True, 1000, 129, 32, torch.float16),
                  (576, True, 1000, 1000, 32, torch.bfloat16),
                  (336, True, 300, 700, 32, torch.bfloat16),
                  (384, True, 7, 300, 8, torch.bfloat16),
                  (512, False, 300, 200, 4, torch.bfloat16),
                  (448, True, 4097, 4097, 2, torch.bfloat16)]


@pytest.mark.parametrize("d,causal,nq,nkv,ratio,dt", ROW_UNIT_CASES)
def test_fused_row_units(seed, d, causal, nq, nkv, ratio, dt):
    """The fused backward by (query block row, key tile) units (`row_units`: each walks the
    row's block in its G query heads, dK / dV added into zeroed fp32 workspaces): all three
    gradients against float64."""
    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), dt=dt,
           plan=lambda p: _fused_plan(p, row_units=True))


# dq_grads (who forms dQ): odd atom counts (D=320, 448), GQA, causal both alignments, N=1
DQ_GRADS_CASES = [(512, False, 1000, 1000, 1), (512, True, 129, 1000, 4),
                  (320, True, 1000, 129, 1), (448, True, 1000, 1000, 2), (384, False, 1, 300, 8)]


@pytest.mark.parametrize("dq_grads", [1, 2])
@pytest.mark.parametrize("d,causal,nq,nkv,ratio", DQ_GRADS_CASES)
def test_fused_dq_in_grads(seed, d, causal, nq, nkv, ratio, dq_grads):
    """The fused backward with dQ formed by the dV warpgroup (`dq_grads` 1) or by the dV and
    dK warpgroups (2): all three gradients against float64."""
    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"),
           plan=lambda p: _fused_plan(p, dq_grads=dq_grads))


@pytest.mark.parametrize("dq_grads", [0, 1])
@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [(512, True, 129, 1000, 8),
                                                   (448, False, 300, 200, 4),
                                                   (512, True, 1000, 1000, 16)])
def test_fused_group_split(seed, d, causal, nq, nkv, ratio, dq_grads):
    """The fused backward with each head group split over CTA pairs (`group_split`: partial
    dK / dV in fp32 workspaces, summed by the host): all three gradients against float64."""
    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"),
           plan=lambda p: _fused_plan(p, dq_grads=dq_grads, group_split=True,
                                             row_units=False))


# D over C CTAs (`scatter`): C = 4 at 1024 and 640, 3 at 576 and 768, 2 at 512; GQA, causal
# both alignments, odd lengths
SCATTER_CASES = [(1024, 4, False, 1000, 1000, 1), (576, 3, True, 129, 1000, 4),
                 (768, 3, True, 1000, 129, 2), (640, 4, False, 7, 300, 8),
                 (512, 2, True, 1000, 1000, 1), (1024, 4, True, 300, 300, 16)]


@pytest.mark.parametrize("d,c,causal,nq,nkv,ratio", SCATTER_CASES)
def test_fused_scatter(seed, d, c, causal, nq, nkv, ratio):
    """The fused backward with D over C CTAs, the score partials reduce-scattered and P^T /
    dS^T gathered (`scatter`; first run 2026-12-05 on an H100): all three gradients
    against float64."""
    from ffpa_cute.common.config import DeltaConfig
    from ffpa_cute.sm90.fused_config import plan_bwd_fused

    def plan(problem):
        cfg = plan_bwd_fused(problem, cluster_d=c, scatter=True)
        return dispatch.BwdPlan(problem, "sm_90a", "sm90", cfgs=(
            DeltaConfig("sm_90a", problem.dtype, problem.head_dim_v), cfg))

    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), plan=plan)


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [(512, True, 129, 1000, 4),
                                                   (320, False, 1000, 1000, 1)])
def test_fused_fp16_and_beside_the_atomic_free_kernels(seed, d, causal, nq, nkv, ratio):
    """fp16 against float64, and bf16 within a few bf16 ulps of the atomic-free kernels (the
    same products; dK / dV summed in another order, dQ by fp32 reductions)."""
    _check(d, causal, nq, nkv, ratio, ("dq", "dk", "dv"), dt=torch.float16, plan=_fused_plan)
    q, k, v, do, problem, out, lse = _inputs(d, causal, nq, nkv, ratio)
    fused = kernels.backward(problem, q, k, v, out, lse, do, "sm90", plan=_fused_plan(problem))
    plain = kernels.backward(problem, q, k, v, out, lse, do, "sm90")
    for x, y in zip(fused, plain):
        assert rel_err(x, y.double()) < 1e-2
