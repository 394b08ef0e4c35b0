"""LoRA evolution operators: registry, invariants, formulas, zero-B handling, errors (CPU; CUDA if present)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from populora_verl.evolution import lora
from populora_verl.evolution.operators import (
    CROSSOVERS,
    MUTATIONS,
    OPERATORS,
    get_operator,
    register_operator,
)

ALL = list(OPERATORS)
EXPECTED = {
    "svd_mutation": "mutation", "layer_gaussian": "mutation", "component_mask": "mutation",
    "full_gaussian": "mutation", "neftune": "mutation", "dare_crossover": "crossover",
    "layer_crossover": "crossover", "svd_crossover": "crossover", "extrapolative_crossover": "crossover",
}
# (in, out) per module type: a miniature transformer with three shape groups plus a repeated one.
SHAPES = {"self_attn.q_proj": (24, 24), "self_attn.k_proj": (24, 8), "mlp.up_proj": (24, 40), "mlp.down_proj": (40, 24)}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_adapter(seed: int = 0, r: int = 4, layers: int = 2, dtype=torch.float32, device="cpu", zero_b=False,
                 extra_key=True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(layers):
        for name, (d_in, d_out) in SHAPES.items():
            p = f"base_model.model.model.layers.{layer}.{name}"
            sd[p + ".lora_A.weight"] = ((torch.rand(r, d_in, generator=g) * 2 - 1) / math.sqrt(d_in)).to(dtype).to(device)
            b = torch.zeros(d_out, r) if zero_b else torch.randn(d_out, r, generator=g) * 0.05
            sd[p + ".lora_B.weight"] = b.to(dtype).to(device)
    if extra_key:  # a non-LoRA key (e.g. modules_to_save) is carried through unchanged
        sd["base_model.model.lm_head.modules_to_save.default.weight"] = torch.randn(5, 3, generator=g).to(dtype).to(device)
    return sd


def parents_for(name: str, seed: int = 0, **kw) -> list[dict[str, torch.Tensor]]:
    return [make_adapter(seed + i, **kw) for i in range(OPERATORS[name].num_parents)]


def gen(seed: int = 0, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def dense(sd) -> dict[str, torch.Tensor]:
    return {m: lora.delta_w(a, b) for m, (a, b) in lora.pair_modules(sd).items()}


def assert_same_delta_w(x, y, atol=1e-4, rtol=1e-4):
    dx, dy = dense(x), dense(y)
    assert dx.keys() == dy.keys()
    for m in dx:
        torch.testing.assert_close(dx[m], dy[m], atol=atol, rtol=rtol, msg=lambda s: f"{m}: {s}")


def assert_child_like(child, parent):
    assert list(child) == list(parent)
    for k, v in parent.items():
        assert child[k].shape == v.shape and child[k].dtype == v.dtype and child[k].device == v.device, k
        assert torch.isfinite(child[k].float()).all(), k
        assert child[k].data_ptr() != v.data_ptr(), f"{k} aliases the parent"


# --- registry -------------------------------------------------------------------------------------------------------


def test_registry_has_the_candidate_set():
    assert {n: OPERATORS[n].kind for n in EXPECTED} == EXPECTED
    assert set(MUTATIONS) | set(CROSSOVERS) == set(OPERATORS)
    for name, op in OPERATORS.items():
        assert op.name == name
        assert op.num_parents == (1 if op.kind == "mutation" else 2)
        assert isinstance(dict(op.defaults), dict) and op.doc
    assert OPERATORS["svd_mutation"].defaults == {"eps": 0.1}
    assert OPERATORS["dare_crossover"].defaults == {"p": 0.7}


def test_register_operator_idiom():
    with pytest.raises(ValueError, match="already been registered"):
        register_operator("svd_mutation", kind="mutation", num_parents=1)(lambda parents, *, generator: parents[0])
    with pytest.raises(ValueError, match="needs a default"):
        @register_operator("_no_default", kind="mutation", num_parents=1)
        def _bad(parents, *, generator, eps):
            return parents[0]
    with pytest.raises(ValueError, match="mutation takes 1 parent"):
        register_operator("_bad_kind", kind="mutation", num_parents=2)
    assert "_no_default" not in OPERATORS

    @register_operator("_test_scale", kind="mutation", num_parents=1)
    def _scale(parents, *, generator, factor: float = 2.0):
        return [g.like(g.A, g.B * factor) for g in parents[0]]

    try:
        parent = make_adapter()
        child = OPERATORS["_test_scale"]([parent], generator=gen(), factor=3.0)
        k = next(k for k in parent if k.endswith("lora_B.weight"))
        torch.testing.assert_close(child[k], parent[k] * 3)
        assert _scale is OPERATORS["_test_scale"].fn  # the decorator returns the function unchanged
    finally:
        OPERATORS.pop("_test_scale", None)


# --- invariants -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ALL)
def test_child_keeps_structure_and_parents_untouched(name, dtype):
    parents = parents_for(name, dtype=dtype)
    before = [{k: v.clone() for k, v in p.items()} for p in parents]
    child = OPERATORS[name](parents, generator=gen(1))
    assert_child_like(child, parents[0])
    for p, b in zip(parents, before):
        for k in p:
            assert torch.equal(p[k], b[k]), f"{name} modified parent key {k}"
    extra = "base_model.model.lm_head.modules_to_save.default.weight"
    assert torch.equal(child[extra], parents[0][extra])


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_child_and_seed_matters(name):
    parents = parents_for(name)
    a = OPERATORS[name](parents, generator=gen(7))
    b = OPERATORS[name](parents, generator=gen(7))
    c = OPERATORS[name](parents, generator=gen(8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    # Operators change the child: none is the identity at its defaults.
    assert lora.delta_w_distance(a, parents[0])[0] > 1e-3


@pytest.mark.parametrize("name,params", [
    ("svd_mutation", {"eps": 0.0}), ("layer_gaussian", {"eps": 0.0}), ("component_mask", {"rho": 0.0}),
    ("full_gaussian", {"eps": 0.0}), ("neftune", {"alpha": 0.0}),
])
def test_zero_strength_mutation_returns_parent_delta_w(name, params):
    parent = make_adapter(3)
    assert_same_delta_w(OPERATORS[name]([parent], generator=gen(), **params), parent)


@pytest.mark.parametrize("name,params", [
    ("svd_crossover", {}), ("svd_crossover", {"k": 2}), ("dare_crossover", {"p": 0.0}), ("layer_crossover", {}),
    ("extrapolative_crossover", {}), ("extrapolative_crossover", {"eta_min": 1.0, "eta_max": 1.0}),
])
def test_identical_parents_crossover_returns_parent_delta_w(name, params):
    parent = make_adapter(4)
    assert_same_delta_w(OPERATORS[name]([parent, parent], generator=gen(2), **params), parent)


def test_bf16_noise_is_computed_in_fp32():
    parent = make_adapter(5, dtype=torch.bfloat16)
    child = OPERATORS["svd_mutation"]([parent], generator=gen(), eps=0.0)
    # Rebuilding in fp32 and casting once keeps the bf16 ΔW within bf16 rounding of the parent's.
    assert_same_delta_w(child, parent, atol=2e-2, rtol=2e-2)


# --- formulas -------------------------------------------------------------------------------------------------------


def test_qr_svd_trick_reconstructs_and_handles_zero_b():
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(3, 5, 30, generator=g), torch.randn(3, 20, 5, generator=g)
    U, S, V = lora.lora_svd(A, B)
    torch.testing.assert_close(U @ torch.diag_embed(S) @ V.transpose(-1, -2), B @ A, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(S, torch.linalg.svdvals(B @ A)[:, :5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(U.transpose(-1, -2) @ U, torch.eye(5).expand(3, 5, 5), atol=1e-5, rtol=0)
    a2, b2 = lora.factors_from_svd(U, S, V, lora.a_row_rms(A))
    torch.testing.assert_close(b2 @ a2, B @ A, atol=1e-4, rtol=1e-4)
    # PEFT's zero B: S = 0, no NaN, rebuilt B = 0 and A rows of the parent's RMS size (trainable, not dead).
    U, S, V = lora.lora_svd(A, torch.zeros_like(B))
    assert torch.isfinite(U).all() and torch.isfinite(V).all() and (S == 0).all()
    a2, b2 = lora.factors_from_svd(U, S, V, lora.a_row_rms(A))
    assert (b2 == 0).all()
    torch.testing.assert_close(a2.norm(dim=-1), lora.a_row_rms(A).unsqueeze(-1).expand(3, 5))


def test_delta_w_distance_matches_dense():
    x, y = make_adapter(1), make_adapter(2)
    dist, ref = lora.delta_w_distance(x, y)
    dx, dy = dense(x), dense(y)
    assert dist == pytest.approx(math.sqrt(sum(float((dx[m] - dy[m]).pow(2).sum()) for m in dx)), rel=1e-4)
    assert ref == pytest.approx(math.sqrt(sum(float(dy[m].pow(2).sum()) for m in dy)), rel=1e-4)


def test_component_mask_drops_ceil_rho_r_components():
    parent = make_adapter(6, r=8)
    child = OPERATORS["component_mask"]([parent], generator=gen(), rho=0.3)  # ceil(2.4) = 3 dropped
    for m, (a, b) in lora.pair_modules(child).items():
        s = torch.linalg.svdvals(lora.delta_w(a, b))
        assert int((s > 1e-5 * s[0]).sum()) == 5, m
    zero = OPERATORS["component_mask"]([parent], generator=gen(), rho=1.0)
    dist, ref = lora.delta_w_distance(zero, parent)
    assert dist == pytest.approx(ref, rel=1e-5)
    assert all(float(d.abs().max()) < 1e-6 for d in dense(zero).values())


def test_svd_mutation_keeps_spectrum_scale_and_changes_directions():
    parent = make_adapter(7, r=8)
    child = OPERATORS["svd_mutation"]([parent], generator=gen(), eps=0.1)
    for m in lora.module_names(parent):
        sp = torch.linalg.svdvals(dense(parent)[m])[:8]
        sc = torch.linalg.svdvals(dense(child)[m])[:8]
        # log-normal with ε = 0.1: each singular value moves by a factor exp(±0.1·z), |z| < 5 here.
        assert ((sc.sort(descending=True).values / sp).log().abs() < 0.5).all(), m
    assert lora.delta_w_distance(child, parent)[0] > 0.01 * lora.delta_w_distance(child, parent)[1]


def test_layer_gaussian_touches_floor_fraction_of_modules():
    parent = make_adapter(8, layers=5)  # L = 20 modules
    child = OPERATORS["layer_gaussian"]([parent], generator=gen(), eps=0.1, fraction=0.33)
    changed = [m for m in lora.module_names(parent)
               if not torch.equal(child[m + ".lora_A.weight"], parent[m + ".lora_A.weight"])]
    assert len(changed) == math.floor(0.33 * 20)
    for m in changed:
        assert not torch.equal(child[m + ".lora_B.weight"], parent[m + ".lora_B.weight"])
    tiny = OPERATORS["layer_gaussian"]([parent], generator=gen(), fraction=0.01)
    assert sum(not torch.equal(tiny[k], parent[k]) for k in parent) == 2  # max(1, ...) module: A and B


def test_gaussian_noise_is_relative_to_std():
    parent = make_adapter(9, r=16)
    child = OPERATORS["full_gaussian"]([parent], generator=gen(), eps=0.15)
    for k, v in parent.items():
        if "lora_" in k:
            ratio = float((child[k] - v).std() / v.std())
            assert 0.1 < ratio < 0.2, (k, ratio)


def test_neftune_bound_and_b_untouched():
    parent = make_adapter(10)
    child = OPERATORS["neftune"]([parent], generator=gen(), alpha=10.0)
    for m, (a, b) in lora.pair_modules(parent).items():
        bound = 10.0 / math.sqrt(a.shape[1] * a.shape[0])
        noise = child[m + ".lora_A.weight"] - a
        assert float(noise.abs().max()) <= bound * (1 + 1e-5) and float(noise.abs().max()) > 0.5 * bound
        assert torch.equal(child[m + ".lora_B.weight"], b)


def test_dare_crossover_is_rescaled_average():
    p0, p1 = make_adapter(11), make_adapter(12)
    avg = OPERATORS["dare_crossover"]([p0, p1], generator=gen(), p=0.0)
    for k in p0:
        if "lora_" in k:
            torch.testing.assert_close(avg[k], (p0[k] + p1[k]) / 2)
    child = OPERATORS["dare_crossover"]([p0, p1], generator=gen(), p=0.5)
    k = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    # every entry is (m0·x0 + m1·x1) / (2·(1 − p)) with m ∈ {0, 1}
    options = torch.stack([torch.zeros_like(p0[k]), p0[k], p1[k], p0[k] + p1[k]])
    assert ((options - child[k]).abs().min(0).values < 1e-6).all()


def test_layer_crossover_copies_whole_pairs():
    p0, p1 = make_adapter(13, layers=4), make_adapter(14, layers=4)
    child = OPERATORS["layer_crossover"]([p0, p1], generator=gen())
    sources = set()
    for m in lora.module_names(p0):
        a, b = m + ".lora_A.weight", m + ".lora_B.weight"
        src = 0 if torch.equal(child[a], p0[a]) else 1
        assert torch.equal(child[a], (p0, p1)[src][a]) and torch.equal(child[b], (p0, p1)[src][b]), m
        sources.add(src)
    assert sources == {0, 1}
    only_first = OPERATORS["layer_crossover"]([p0, p1], generator=gen(), p_first=1.0)
    assert all(torch.equal(only_first[k], p0[k]) for k in p0)


def test_svd_crossover_takes_leading_components_from_fitter_parent():
    p0, p1 = make_adapter(15, r=6), make_adapter(16, r=6)
    assert_same_delta_w(OPERATORS["svd_crossover"]([p0, p1], generator=gen(), k=6), p0)
    assert_same_delta_w(OPERATORS["svd_crossover"]([p0, p1], generator=gen(), k=0), p1)
    child = OPERATORS["svd_crossover"]([p0, p1], generator=gen(), k=2)
    for m, (a0, b0) in lora.pair_modules(p0).items():
        u0, s0, v0 = lora.lora_svd(a0, b0)
        u1, s1, v1 = lora.lora_svd(*lora.pair_modules(p1)[m])
        want = (u0[:, :2] * s0[:2]) @ v0[:, :2].T + (u1[:, 2:] * s1[2:]) @ v1[:, 2:].T
        torch.testing.assert_close(dense(child)[m], want, atol=1e-4, rtol=1e-4)


def test_extrapolative_crossover_overshoots_past_parents0():
    p0, p1 = make_adapter(17), make_adapter(18)
    child = OPERATORS["extrapolative_crossover"]([p0, p1], generator=gen(), eta_min=1.25, eta_max=1.25)
    for k in p0:
        if "lora_" in k:
            torch.testing.assert_close(child[k], p1[k] + 1.25 * (p0[k] - p1[k]))
    assert all(torch.equal(a, b) for a, b in zip(
        OPERATORS["extrapolative_crossover"]([p0, p1], generator=gen(), eta_min=1, eta_max=1).values(), p0.values()))


# --- zero B (PEFT initialisation) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_zero_b_parent_gives_valid_child(name):
    parents = parents_for(name, zero_b=True)
    child = OPERATORS[name](parents, generator=gen())
    assert_child_like(child, parents[0])
    pairs = lora.pair_modules(child)
    b_zero = all((b == 0).all() for _, b in pairs.values())
    if name in ("layer_gaussian", "full_gaussian"):
        assert not b_zero  # the 1/sqrt(r) fallback std puts noise on a zero B
    elif name in ("svd_mutation", "component_mask", "svd_crossover", "neftune"):
        assert b_zero  # a zero ΔW stays zero ...
    # ... and every A row stays alive (non-zero), so training can move B off zero.
    assert all((a.norm(dim=-1) > 0).all() for a, _ in pairs.values())


# --- errors ---------------------------------------------------------------------------------------------------------


def test_errors_are_clear():
    p = make_adapter()
    with pytest.raises(TypeError, match="epsilon"):
        OPERATORS["svd_mutation"]([p], generator=gen(), epsilon=0.1)
    with pytest.raises(ValueError, match="exactly 2 parent"):
        OPERATORS["svd_crossover"]([p], generator=gen())
    with pytest.raises(ValueError, match="exactly 1 parent"):
        OPERATORS["neftune"]([p, p], generator=gen())
    with pytest.raises(TypeError, match="sequence of state dicts"):
        OPERATORS["neftune"](p, generator=gen())
    with pytest.raises(TypeError, match="generator"):
        OPERATORS["neftune"]([p], generator=0)
    with pytest.raises(ValueError, match="'p'"):
        OPERATORS["dare_crossover"]([p, p], generator=gen(), p=1.0)
    with pytest.raises(ValueError, match="'rho'"):
        OPERATORS["component_mask"]([p], generator=gen(), rho=1.5)
    with pytest.raises(ValueError, match="'k'"):
        OPERATORS["svd_crossover"]([p, p], generator=gen(), k=99)
    with pytest.raises(ValueError, match="different keys"):
        OPERATORS["layer_crossover"]([p, make_adapter(layers=1)], generator=gen())
    with pytest.raises(ValueError, match="differ at"):
        OPERATORS["layer_crossover"]([p, make_adapter(r=2)], generator=gen())
    with pytest.raises(ValueError, match="unknown operator 'nope'"):
        get_operator("nope")
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        OPERATORS["neftune"]([{"w": torch.zeros(2)}], generator=gen())
    bad = dict(p)
    del bad["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
    with pytest.raises(ValueError, match="unpaired"):
        OPERATORS["neftune"]([bad], generator=gen())


# --- property tests -------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(r=st.integers(1, 6), d_in=st.integers(1, 12), d_out=st.integers(1, 12), n=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1), zero=st.booleans())
def test_property_svd_trick(r, d_in, d_out, n, seed, zero):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, r, d_in, generator=g)
    B = torch.zeros(n, d_out, r) if zero else torch.randn(n, d_out, r, generator=g)
    U, S, V = lora.lora_svd(A, B)
    assert torch.isfinite(U).all() and torch.isfinite(V).all() and (S >= 0).all()
    a2, b2 = lora.factors_from_svd(U, S, V, lora.a_row_rms(A))
    assert a2.shape == A.shape and b2.shape == B.shape
    torch.testing.assert_close(b2 @ a2, B @ A, atol=1e-4, rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(ALL), r=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), zero_b=st.booleans())
def test_property_any_operator_any_rank(name, r, seed, zero_b):
    parents = parents_for(name, seed=seed % 1000, r=r, layers=1, zero_b=zero_b, extra_key=False)
    a = OPERATORS[name](parents, generator=gen(seed))
    b = OPERATORS[name](parents, generator=gen(seed))
    assert_child_like(a, parents[0])
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- CUDA -----------------------------------------------------------------------------------------------------------


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
def test_cuda_operators(name):
    parents = parents_for(name, dtype=torch.bfloat16, device="cuda")
    child = OPERATORS[name](parents, generator=gen(0, "cuda"))
    assert_child_like(child, parents[0])
    again = OPERATORS[name](parents, generator=gen(0, "cuda"))
    assert all(torch.equal(child[k], again[k]) for k in child)
    # a CPU generator drives CUDA adapters too (noise drawn on CPU, moved)
    assert_child_like(OPERATORS[name](parents, generator=gen(0)), parents[0])


def test_cholesky_qr_matches_householder_and_falls_back():
    # The GPU path's QR, run on CPU: a valid thin QR (diag(R) >= 0) also for zero and rank-deficient entries.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 50, 6, generator=g)
    x[1] = 0  # PEFT's zero B
    x[2, :, 3] = x[2, :, 0]  # rank-deficient
    q, r = lora.cholesky_qr(x)
    assert torch.isfinite(q).all() and torch.isfinite(r).all()
    torch.testing.assert_close(q @ r, x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q.mT @ q, torch.eye(6).expand(4, 6, 6), atol=1e-5, rtol=0)
    assert (torch.diagonal(r, dim1=-2, dim2=-1) >= 0).all()
    q_ref, r_ref = lora._sign_fixed_qr(x[[0, 3]])
    torch.testing.assert_close(q[[0, 3]], q_ref, atol=1e-5, rtol=1e-5)


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
def test_cuda_operators_on_untrained_adapters(name):
    # PEFT's zero B gives zero cores, which cuSOLVER's batched gesvda refuses outright.
    parents = parents_for(name, dtype=torch.bfloat16, device="cuda", zero_b=True)
    assert_child_like(OPERATORS[name](parents, generator=gen(0, "cuda")), parents[0])


def _fake_gesvda(monkeypatch, refuse: bool, garble: int | None = None) -> list:
    """torch.linalg.svd as cuSOLVER's gesvda behaves, on CPU: it refuses a batch with a rank-deficient core, or
    returns one core's factors inaccurate. Records the drivers asked for."""
    real, calls = torch.linalg.svd, []

    def svd(x, full_matrices=True, driver=None):
        calls.append(driver)
        if driver == "gesvda" and refuse and bool((torch.linalg.matrix_rank(x) < x.shape[-1]).any()):
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        u, s, vh = real(x, full_matrices=full_matrices)
        if driver == "gesvda" and garble is not None:
            u = u.clone()
            u[garble] = 0.5
        return u, s, vh

    monkeypatch.setattr(torch.linalg, "svd", svd)
    return calls


@pytest.mark.parametrize("case", ["refused", "inaccurate"])
def test_batched_core_svd_falls_back_to_the_exact_driver(monkeypatch, case):
    g = torch.Generator().manual_seed(0)
    c = torch.randn(5, 8, 8, generator=g)
    c[1] = 0  # an untrained adapter's core
    c[3] = torch.outer(torch.randn(8, generator=g), torch.randn(8, generator=g))  # rank 1
    calls = _fake_gesvda(monkeypatch, refuse=case == "refused", garble=2 if case == "inaccurate" else None)
    u, s, vh = lora._checked_batched_svd(c, driver="gesvda")
    assert calls == ["gesvda", None]
    torch.testing.assert_close((u * s.unsqueeze(-2)) @ vh, c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(u.mT @ u, torch.eye(8).expand(5, 8, 8), atol=1e-5, rtol=0)
    assert u.dtype == c.dtype and (s[:, :-1] >= s[:, 1:]).all()
