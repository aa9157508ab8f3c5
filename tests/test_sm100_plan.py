"""The sm100 forward's resource plan and mbarrier protocol, proved on the CPU (the kernels are
compile-verified only, never run: no sm_100 GPU exists here).

- every planned D fits TMEM (<= 512 columns, regions disjoint apart from P inside its S) and
  the allocation is a power of two covering them; smem fits sm_100a; the warp roles fit the
  register file and the CTA;
- the protocol model (ffpa_cute/sm100/protocol.py), driven by the config's own barrier
  counts and ring depths, finishes without a deadlock or a hazard over many interleavings and
  block counts, and catches the faults it exists to catch."""

import dataclasses

import pytest

from ffpa_cute.problem import AttnProblem
from ffpa_cute.sm100 import config as c100
from ffpa_cute.sm100 import protocol

HEAD_DIMS = (264, 320, 512, 576, 768, 1024)


def plan(d, dv=None, causal=False, multicast=True):
    p = AttnProblem(dtype="bf16", batch=1, heads_q=4, heads_kv=4, seqlen_q=1000,
                    seqlen_kv=1000, head_dim=d, head_dim_v=dv or d, causal=causal)
    return c100.plan_fwd(p, multicast=multicast)


@pytest.mark.parametrize("d", [*HEAD_DIMS, *range(264, 1025, 8)][::7] + list(HEAD_DIMS))
def test_tmem_ledger(d):
    cfg = plan(d)
    regions = cfg.tmem_regions()
    assert cfg.tmem_columns_used <= c100.TMEM_COLUMNS
    assert cfg.tmem_alloc_columns in (32, 64, 128, 256, 512)
    assert cfg.tmem_columns_used <= cfg.tmem_alloc_columns
    spans = {name: (c, c + w) for name, c, w in regions}
    for a in ("S0", "S1", "acc"):  # S0, S1 and O are disjoint
        for b in ("S0", "S1", "acc"):
            if a < b:
                assert spans[a][1] <= spans[b][0] or spans[b][1] <= spans[a][0], (a, b)
    for i in (0, 1):  # P[i] (16-bit, two per column) lies inside S[i]
        lo, hi = spans[f"P{i}"]
        assert spans[f"S{i}"][0] <= lo and hi <= spans[f"S{i}"][1]
        assert hi - lo == cfg.tile_n // 2
    assert spans["acc"][1] - spans["acc"][0] == cfg.acc_cta >= -(-cfg.acc_dim // cfg.o_split)
    assert cfg.acc_cta % 16 == 0 and cfg.acc_cta <= c100.MAX_MMA_N


@pytest.mark.parametrize("d,dv", [(d, None) for d in HEAD_DIMS] + [(576, 512), (512, 128)])
def test_smem_and_roles(d, dv):
    cfg = plan(d, dv)
    assert c100.can_implement(cfg) is None
    assert cfg.smem_bytes() <= c100.SMEM_CAPACITY
    assert cfg.qk_stages >= 3 and cfg.v_stages >= 2
    warps = sorted((first, first + n) for _, first, n, _ in c100.WARP_ROLES)
    assert warps[0][0] == 0 and all(a[1] == b[0] for a, b in zip(warps, warps[1:]))
    assert c100.num_threads() == 32 * warps[-1][1] <= 1024
    assert sum(32 * n * r for *_, n, r in c100.WARP_ROLES) <= c100.REGISTER_FILE
    # one softmax thread per TMEM lane (= query row)
    assert dict((r, n) for r, _, n, _ in c100.WARP_ROLES)["softmax"] * 32 == c100.TMEM_LANES


def test_can_implement_rejects():
    cfg = plan(512)
    assert "arch" in c100.can_implement(dataclasses.replace(cfg, arch="sm_90a"))
    assert "head_dim" in c100.can_implement(dataclasses.replace(cfg, head_dim=516))
    assert "smem" in c100.can_implement(dataclasses.replace(cfg, qk_stages=8, v_stages=8))
    fp8 = c100.plan_fwd(AttnProblem(dtype="e4m3", batch=1, heads_q=1, heads_kv=1, seqlen_q=8,
                                    seqlen_kv=8, head_dim=512, head_dim_v=512, window_lo=-4,
                                    has_sinks=True))
    assert fp8.window and fp8.sinks and c100.can_implement(fp8) is None  # e4m3: both
    assert "forwards' field" in c100.can_implement(
        dataclasses.replace(bwd_plans(512)[0], sinks=True))


def bwd_plans(d, dv=None, multicast=True):
    p = AttnProblem(dtype="bf16", batch=1, heads_q=8, heads_kv=2, seqlen_q=1000,
                    seqlen_kv=1000, head_dim=d, head_dim_v=dv or d)
    return c100.plan_bwd(p, multicast=multicast)


@pytest.mark.parametrize("d,dv", [(d, None) for d in HEAD_DIMS] + [(576, 512)])
def test_backward_plans(d, dv):
    """dQ, dK (two products: S and dP fill both score buffers, no lookahead) and dV (one, as
    the forward) fit TMEM, smem and the register budget; accumulators as wide as their
    gradients."""
    dq, dk, dv_ = bwd_plans(d, dv)
    assert (dq.acc_dim, dk.acc_dim, dv_.acc_dim) == (d, d, dv or d)
    assert dq.products == dk.products == (d, dv or d) and dv_.products == (d,)
    assert not dq.rows_are_keys and dk.rows_are_keys and dv_.rows_are_keys
    assert (dq.col_stats, dk.col_stats, dv_.col_stats) == (0, 2, 1)
    for cfg in (dq, dk, dv_):
        assert c100.can_implement(cfg) is None and cfg.smem_bytes() <= c100.SMEM_CAPACITY
        assert cfg.tmem_columns_used <= c100.TMEM_COLUMNS
        assert cfg.lookahead == (1 if cfg is dv_ else 0)
        assert cfg.score_bufs == (2 if cfg is dv_ else 1)
        names = [n for n, *_ in cfg.tmem_regions()]
        assert names == (["S0", "P0", "S1", "P1", "acc"] if cfg is dv_
                         else ["S", "dS", "dP", "acc"])


@pytest.mark.parametrize("d", [264, 512, 1024])
def test_protocol_model_backward(d):
    for cfg in bwd_plans(d):
        for blocks in (0, 1, 2, 7, 20):
            for seed in range(6):
                protocol.run(cfg, blocks, seed)


@pytest.mark.parametrize("multicast", [True, False])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_protocol_model(d, multicast):
    """Hundreds of steps per tile (its cluster of o_split CTAs with `multicast`): no deadlock,
    no hazard, for block counts 0 .. 40."""
    cfg = plan(d, multicast=multicast)
    assert cfg.cluster_size == (cfg.o_split if multicast else 1)
    for blocks in (0, 1, 2, 3, 5, 17, 40):
        for seed in range(8):
            steps = protocol.run(cfg, blocks, seed)
            assert blocks < 5 or steps > 200


class _NoWaitOnPV(protocol.Model):
    """A fault: the softmax threads read O (rescale, epilogue) without waiting for the PV
    MMAs."""

    def done(self, bar, phase):
        return True if bar.endswith("o_done[0]") else super().done(bar, phase)


class _ShallowLoader(protocol.Model):
    """A fault: the load thread believes the QK ring is one stage shallower than the MMA's
    (a hang: the MMA waits on a stage that is never filled)."""

    def __init__(self, cfg, blocks, seed):
        super().__init__(cfg, blocks, seed)
        self.role_cfg["load"] = dataclasses.replace(cfg, qk_stages=cfg.qk_stages - 1)


class _NoEmptyWait(protocol.Model):
    """A fault: the load thread refills QK stages without waiting for the MMAs to free them."""

    def done(self, bar, phase):
        return True if "qk_empty" in bar else super().done(bar, phase)


class _FewerArrivals(protocol.Model):
    """A fault: p_full expects one arrival more than the softmax threads give."""

    def __init__(self, cfg, blocks, seed):
        super().__init__(cfg, blocks, seed)
        for i in range(cfg.score_bufs):
            self.bars[self.bar(0, "p_full", i)].count += 1


class _LocalRelease(protocol.Model):
    """A fault of the cluster: each MMA thread releases a QK stage on its own CTA only, and
    the stage's owner refills it on every CTA once its own MMAs are done with it (a peer may
    still be reading it)."""

    def __init__(self, cfg, blocks, seed):
        super().__init__(cfg, blocks, seed)
        for bar in self.bars:
            if "qk_empty" in bar:
                self.bars[bar].count = 1

    def commit_targets(self, cta, name):
        return range(cta, cta + 1)


class _PeerDoesNotExpect(protocol.Model):
    """A fault of the cluster: only the chunk's owner posts the stage's expected bytes; the
    peers' phases complete on the arrival alone, before the data lands."""

    def expected(self, cta, chunk):
        return protocol.STAGE_BYTES if self.owner(chunk) == cta else 0


@pytest.mark.parametrize("fault,multicast", [
    (_NoWaitOnPV, False), (_ShallowLoader, False), (_NoEmptyWait, False),
    (_FewerArrivals, False), (_NoWaitOnPV, True), (_NoEmptyWait, True),
    (_LocalRelease, True), (_PeerDoesNotExpect, True)])
def test_protocol_model_catches_faults(fault, multicast):
    cfg = plan(512, multicast=multicast)
    with pytest.raises(protocol.ProtocolError):
        for seed in range(40):
            fault(cfg, 9, seed).run(max_steps=20000)


@pytest.mark.parametrize("fault", [_NoEmptyWait, _LocalRelease, _FewerArrivals])
def test_protocol_model_catches_faults_in_the_backward(fault):
    """The two-product form (dK: S and dP per block, no lookahead) too."""
    cfg = bwd_plans(512)[1]
    with pytest.raises(protocol.ProtocolError):
        for seed in range(40):
            fault(cfg, 9, seed).run(max_steps=20000)


@pytest.mark.parametrize("d", [272, 320, 512, 576, 1024])
def test_fp8_plans(d):
    """The e4m3 forward: 128-column chunks, P in e4m3 (32 TMEM columns inside its S), the
    accumulator N a multiple of 32, the budgets met; the protocol model passes."""
    p = AttnProblem(dtype="e4m3", batch=1, heads_q=8, heads_kv=2, seqlen_q=1000,
                    seqlen_kv=1000, head_dim=d, head_dim_v=d, out_dtype="bf16")
    cfg = c100.plan_fwd(p)
    assert isinstance(cfg, c100.FwdFP8ConfigSm100) and cfg.out_dtype == "bf16"
    assert (cfg.k_chunk, cfg.mma_k) == (128, 32) and cfg.acc_cta % 32 == 0
    spans = {name: (c, c + w) for name, c, w in cfg.tmem_regions()}
    assert spans["P0"][1] - spans["P0"][0] == cfg.tile_n // 4
    assert c100.can_implement(cfg) is None and cfg.smem_bytes() <= c100.SMEM_CAPACITY
    assert cfg.tmem_columns_used <= c100.TMEM_COLUMNS and cfg.rescales_acc
    for blocks in (0, 3, 11):
        protocol.run(cfg, blocks, seed=blocks)
    with pytest.raises(ValueError, match="multiples of 16"):
        c100.plan_fwd(dataclasses.replace(p, head_dim=264, head_dim_v=264))


@pytest.mark.parametrize("d", range(320, 1025, 64))
def test_nvfp4_plans(d):
    """The NVFP4 forward at every D it takes: 256-element chunks (K = 64 per MMA), O in
    192-column slices (o_split = ceil(D / 192)), TMEM's S buffers, scale regions and O
    disjoint inside 512 columns, smem inside sm_100a's (P and every stage's scales included),
    V^T's scale rows covering the two atoms of every slice; the protocol model passes (P's
    buffer moves from TMEM to shared memory with the same lifetime: written after s_full,
    read by the PV MMAs)."""
    p = AttnProblem(dtype="nvfp4", batch=1, heads_q=8, heads_kv=2, seqlen_q=1000,
                    seqlen_kv=1000, head_dim=d, head_dim_v=d, out_dtype="bf16")
    cfg = c100.plan_fwd(p)
    assert isinstance(cfg, c100.FwdFP4ConfigSm100) and c100.can_implement(cfg) is None
    assert (cfg.k_chunk, cfg.mma_k, cfg.acc_cta) == (256, 64, 192)
    assert cfg.o_split == -(-d // 192) and cfg.multicast
    spans = sorted((c, c + w) for _, c, w in cfg.tmem_regions())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= 512
    regions = dict((n, (c, w)) for n, c, w in cfg.tmem_regions())
    assert regions["SF_QK"][1] == 2 * 4 * cfg.k_chunk // 64  # Q's and K's, 4 per K-block
    assert regions["SF_PV"][1] == 2 * 4 + 2 * 4  # P's two K-blocks, V^T's two atoms
    assert cfg.smem_bytes() <= c100.SMEM_CAPACITY and cfg.qk_stages >= 3
    assert dict(cfg.smem_regions())["p"] == 2 * 128 * 128 // 2
    for o_part in range(cfg.o_split):  # each slice's rows inside its two scale atoms
        first = o_part * 192
        atom0 = first // c100.SF_ATOM_ROWS
        assert first + 192 <= (atom0 + 2) * c100.SF_ATOM_ROWS <= cfg.vt_scale_rows()
        assert first % 32 == 0  # the TMEM scale pointer moves by whole columns
    for blocks in (0, 3, 11):
        protocol.run(cfg, blocks, seed=blocks)
    with pytest.raises(ValueError, match="multiple of 64"):
        c100.plan_fwd(dataclasses.replace(p, head_dim=d + 8, head_dim_v=d + 8))
    with pytest.raises(ValueError, match="Dv == D"):
        c100.plan_fwd(dataclasses.replace(p, head_dim_v=d - 64))
    featured = c100.plan_fwd(dataclasses.replace(p, has_sinks=True, window_lo=-64))
    assert featured.sinks and featured.window and c100.can_implement(featured) is None
