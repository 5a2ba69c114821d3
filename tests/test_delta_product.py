"""DeltaProduct (issue 40): a product of n rank-1 steps per token, each with its own key, gain and
write, the decay on the first. The frontend parses the nested form into steps and prints it back;
the reference computes the product token by token (n steps each); chunk, recurrent and step run
the steps as n sub-tokens of a one-step sub-mixer (codegen/product.py). Every path against the
float64 reference, forward and backward: packed sequences, grouped value heads, strong decays."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_dplr import against_reference, failing, tiered
from test_recurrent import DEVICE

import lrdsl
from lrdsl.errors import SpecError
from lrdsl.frontend import printer, spec_to_ir
from lrdsl.testing import Case, check_case, draw_inputs, rms_ratio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = ["delta_product2", "delta_product3"]
# a decay per key channel and an erase read along its own direction (Comba's), three steps
KDA_PRODUCT = """mixer kda_product
input q[K] l2norm, k[K] l2norm, k2[K] l2norm, p[K] l2norm, v[V], v2[V], v3[V]
input b1 in (0, 1), b2 in (0, 2), b3 in (0, 1), g[K] log
S = (I - b3 k k^T) ((I - b2 k2 p^T) ((I - b1 k k^T) diag(exp(g)) S + b1 k v^T) + b2 k2 v2^T) + b3 k v3^T
o = S^T q
allow unstable
"""


@pytest.fixture(scope="module")
def mixers(compiled):
    def get(name):
        if name == "kda_product":
            return lrdsl.compile(text=KDA_PRODUCT)
        return compiled(EXAMPLES / f"{name}.lr")
    return get


# ---- the frontend ------------------------------------------------------------------------------
def test_nested_form_parses_into_steps_and_prints_back():
    for text, n in [((EXAMPLES / "delta_product2.lr").read_text(), 2), ((EXAMPLES / "delta_product3.lr").read_text(), 3),
                    (KDA_PRODUCT, 3)]:
        m = spec_to_ir(text)
        assert m.n_steps == n
        assert spec_to_ir(printer.explicit(m)) == m
    m = spec_to_ir((EXAMPLES / "delta_product3.lr").read_text())
    assert [str(s.delta.a) for s in m.steps] == ["b2*k2", "b3*k3"]
    assert str(m.delta.a) == "b1*k" and m.decay.kind == "scalar"
    update = next(line for line in printer.explicit(m).splitlines() if line.startswith("S = "))
    assert update.count("(I - ") == 3 and update.endswith("(b3*k3) v3^T")


def test_delta_rule_steps_on_plain_inputs_take_the_direct_sub_mixer():
    """Delta-rule steps on the spec's own keys and values run the gated delta rule on them (only the
    gains are computed around the kernels); an erase along another direction, a clamped value or a
    step without erase takes the per-step vectors. Every path test here runs both kinds."""
    from lrdsl.codegen.product import direct, sub_ir
    m = spec_to_ir((EXAMPLES / "delta_product3.lr").read_text())
    d = direct(m)
    assert (d.query, d.keys, d.values, tuple(map(str, d.gains))) == ("q", ("k", "k2", "k3"), ("v", "v2", "v3"),
                                                                      ("b1", "b2", "b3"))
    sub = sub_ir(m)
    assert [i.name for i in sub.inputs] == ["q", "k", "v", "beta", "g"]
    assert [i.l2norm for i in sub.inputs[:3]] == [True, True, False]
    assert direct(spec_to_ir(KDA_PRODUCT)) is None and "w" in [i.name for i in sub_ir(spec_to_ir(KDA_PRODUCT)).inputs]
    clamped = BASE.replace("v2[V]", "v2[V] in (-1, 1)") + "S = (I - b2 k2 k2^T) ((I - b1 k k^T) exp(g) S + b1 k v^T) + b2 k2 v2^T\no = S^T q\n"
    assert direct(spec_to_ir(clamped)) is None
    no_erase = BASE + "S = (I - b2 k2 k2^T) (exp(g) S + b1 k v^T) + b2 k2 v2^T\no = S^T q\n"
    assert direct(spec_to_ir(no_erase)) is None


def _error(text: str) -> SpecError:
    with pytest.raises(SpecError) as e:
        spec_to_ir(text)
    return e.value


BASE = "mixer m\ninput q[K] l2norm, k[K] l2norm, k2[K] l2norm, v[V], v2[V], b1 in (0, 1), b2 in (0, 1), g log\n"


@pytest.mark.parametrize("update, words", [
    # a decay on a later step: one decay per token, on the first
    ("(I - b2 k2 k2^T) exp(g) ((I - b1 k k^T) S + b1 k v^T) + b2 k2 v2^T", "step 2 of the product has a decay"),
    # a later step without its write
    ("(I - b2 k2 k2^T) ((I - b1 k k^T) exp(g) S + b1 k v^T)", "step 2 of the product has no write"),
    # two erases with no write between them: the dot product the nested form avoids
    ("(I - b2 k2 k2^T) (I - b1 k k^T) exp(g) S + b1 k v^T", "written nested"),
    # S both inside and outside the product
    ("(I - b2 k2 k2^T) ((I - b1 k k^T) exp(g) S + b1 k v^T) + S", "S enters once"),
])
def test_unsupported_products_are_one_clear_error(update, words):
    e = _error(BASE + f"S = {update}\no = S^T q\n")
    assert words in str(e) and e.span is not None and e.span.line == 3, str(e)


def test_product_with_auxiliary_state_is_refused():
    e = _error(BASE + "state P[K] = 0.5 * P + k\n"
               "S = (I - b2 k2 k2^T) ((I - b1 k k^T) exp(g) S + b1 k v^T) + b2 k2 v2^T\no = S^T (q * P)\n")
    assert "auxiliary states" in str(e) and e.span is not None, str(e)


# ---- the reference, independently ---------------------------------------------------------------
def test_reference_is_the_product_of_the_steps(mixers):
    """The reference against dense matrices: M_t = (I - b2 k2 k2^T)(I - b1 k k^T) exp(g), and the
    writes b1 (I - b2 k2 k2^T) k v^T + b2 k2 v2^T."""
    mixer = mixers("delta_product2")
    case = Case(B=1, T=7, H=1, HV=1, K=5, V=3, initial_state=True, seed=1)
    x, opts = draw_inputs(mixer, case)
    x = {n: t.double() for n, t in x.items()}
    S = opts["initial_state"].double()[0, 0]
    o, s = mixer.reference(**x, initial_state=S[None, None], output_final_state=True)
    unit = lambda t: t * torch.rsqrt((t * t).sum() + 1e-6)  # noqa: E731 (the mixer's l2norm)
    eye = torch.eye(case.K, dtype=torch.float64)
    for t in range(case.T):
        k, k2, q = (unit(x[n][0, t, 0]) for n in ("k", "k2", "q"))
        b1, b2, g = (x[n][0, t, 0] for n in ("b1", "b2", "g"))
        F1, F2 = eye - b1 * torch.outer(k, k), eye - b2 * torch.outer(k2, k2)
        S = F2 @ (F1 @ (g.exp() * S) + b1 * torch.outer(k, x["v"][0, t, 0])) + b2 * torch.outer(k2, x["v2"][0, t, 0])
        assert torch.allclose(o[0, t, 0], S.T @ (q * case.K ** -0.5), rtol=1e-10, atol=1e-12)
    assert torch.allclose(s[0, 0], S, rtol=1e-10, atol=1e-12)


# ---- every path against the reference ------------------------------------------------------------
CASES = {
    "batch-h0": Case(B=2, T=20, H=1, HV=1, K=16, V=8, initial_state=True, seed=1),
    "varlen-HV2H": Case(B=1, T=37, H=2, HV=4, K=16, V=8, cu_seqlens=(0, 5, 5, 30, 37), initial_state=True,
                        seed=2),
    "long-HV2H": Case(B=1, T=70, H=1, HV=2, K=32, V=16, initial_state=True, seed=3),
}


@pytest.mark.parametrize("name, case_id", tiered(
    [(n, c) for n in [*NAMES, "kda_product"] for c in CASES],
    [("delta_product2", "varlen-HV2H")]))
def test_every_path_matches_the_reference(mixers, name, case_id):
    """recurrent and chunk forward, and chunk's gradient of every input and of the initial state
    (check_case: packed sequences with an empty one, grouped value heads HV = 2 H, an initial state)."""
    out = check_case(mixers(name), CASES[case_id], DEVICE, grad=True)
    assert out.ok, out.message


def strong(x, value, where):
    g = x["g"].clone()
    g[:, where] = value
    return dict(x, g=g)


STRONG = {  # tokens: one at -1e4 and at -inf, a whole 16-token block (32 or 48 sub-tokens) at -inf,
    "one-1e4": ((3, 17), -1e4),  # and 8 tokens that are one whole 16-sub-token block of the sub-mixer
    "one-inf": ((3, 17), -float("inf")),
    "block-inf": (slice(16, 32), -float("inf")),
    "subblock-inf": (slice(8, 16), -float("inf")),
}


@pytest.mark.parametrize("name, strength", tiered([(n, s) for n in [*NAMES, "kda_product"] for s in STRONG],
                                                  [("delta_product2", "one-inf"), ("delta_product3", "subblock-inf")]))
def test_strong_decays(mixers, name, strength):
    """A log-decay of -1e4 or -inf on single tokens and whole blocks: chunk forward and every
    gradient, and recurrent, match the float64 reference (no exp(-g) anywhere)."""
    mixer = mixers(name)
    x, opts = draw_inputs(mixer, Case(B=1, T=40, H=1, HV=2, K=16, V=8, initial_state=True, seed=7), DEVICE)
    where, value = STRONG[strength]
    bad = failing(against_reference(mixer, strong(x, value, where), opts))
    assert not bad, bad


@pytest.mark.parametrize("name", NAMES)
def test_step_decodes_token_by_token(mixers, name):
    """step, one token and then several at once, updating the state in place, equals the reference."""
    mixer = mixers(name)
    x, opts = draw_inputs(mixer, Case(B=2, T=6, H=1, HV=2, K=16, V=8, initial_state=True, seed=5), DEVICE)
    x = strong(x, -float("inf"), (2,))
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()},
                                   initial_state=opts["initial_state"].double(), output_final_state=True)
    state = opts["initial_state"].clone().contiguous()
    outs = []
    with torch.no_grad():
        for a, b in ((0, 1), (1, 4), (4, 6)):
            sl = {n: t[:, a:b] for n, t in x.items()}
            outs.append(mixer.step(sl.pop("q"), sl.pop("k"), sl.pop("v"), state, **sl))
    assert rms_ratio(torch.cat(outs, 1), ref_o) < 1e-5 and rms_ratio(state, ref_s) < 1e-5


def test_bf16_chunk_on_the_cpu(mixers):
    """bf16 inputs (run on fp32 copies in the interpreter) give o in bf16, close to the reference."""
    mixer = mixers("delta_product2")
    x, opts = draw_inputs(mixer, Case(B=1, T=20, H=1, HV=1, K=16, V=8, seed=6), DEVICE)
    x16 = {n: t.bfloat16() for n, t in x.items()}
    o, _ = mixer.chunk(**x16, **opts)
    ref, _ = mixer.reference(**{n: t.double() for n, t in x16.items()}, **opts)
    assert o.dtype == torch.bfloat16 and rms_ratio(o, ref) < 1e-2


# ---- the checker --------------------------------------------------------------------------------
def test_checker_facts_of_products(mixers):
    """Two steps with gains in (0, 1): each factor a PSD contraction, so the product is bounded and
    has no negative eigenvalue; three with gains in (0, 2): a witness reaches a negative one."""
    f2 = mixers("delta_product2").check()
    assert f2["facts"] == {"spectral_norm_le_1": "proved", "stable": "proved", "bounded_state": "proved",
                           "negative_eigenvalues": "disproved"}
    f3 = mixers("delta_product3").check()
    assert f3["facts"]["bounded_state"] == "proved" and f3["facts"]["negative_eigenvalues"] == "proved"
    assert f3["witnesses"]["negative_eigenvalues"]["value"] < -0.5
    assert [s["spectral_norm_le_1"] for s in f3["steps"]] == ["proved"] * 3


def test_a_growing_step_is_refused_with_a_witness_of_the_product():
    text = BASE.replace("b2 in (0, 1)", "b2 in (0, 3)") + (
        "S = (I - b2 k2 k2^T) ((I - b1 k k^T) exp(g) S + b1 k v^T) + b2 k2 v2^T\no = S^T q\n")
    with pytest.raises(SpecError) as e:
        lrdsl.compile(text=text, load_kernels=False)
    msg = str(e.value)
    assert "step 2 is not proved" in msg and "b2" in msg and "spectral radius" in msg, msg
    assert msg.count("allow unstable") == 1
    m = lrdsl.compile(text=text + "allow unstable\n", load_kernels=False)
    f = m.check()
    assert f["facts"]["stable"] == "disproved" and f["facts"]["bounded_state"] == "disproved"
    # the witness is one for the product: its transition, rebuilt here, has that spectral radius
    w = f["witnesses"]["stable"]["steps"][0]
    k, k2 = (torch.tensor(w[n], dtype=torch.float64) for n in ("k", "k2"))
    M = ((torch.eye(2, dtype=torch.float64) - w["b2"] * torch.outer(k2, k2))
         @ (torch.eye(2, dtype=torch.float64) - w["b1"] * torch.outer(k, k)) * torch.tensor(w["g"]).exp())
    assert abs(torch.linalg.eigvals(M).abs().max().item() - f["witnesses"]["stable"]["value"]) < 1e-4


# ---- the layer ------------------------------------------------------------------------------------
def test_layer_prefill_then_decode_and_gradients(mixers):
    from lrdsl.nn import Layer
    torch.manual_seed(0)
    L = Layer(mixers("delta_product2"), 32, 2, 16, num_v_heads=4)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, _ = L(x)
        parts, cache = L(x[:, :7], use_cache=True)
        outs = [parts]
        for a, b in ((7, 8), (8, 12)):
            y, cache = L(x[:, a:b], cache)
            outs.append(y)
    assert rms_ratio(torch.cat(outs, 1), whole) < 1e-5
    y, _ = L(x)
    y.pow(2).sum().backward()
    missing = [n for n, p in L.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


def test_layer_compiles_without_a_graph_break(mixers):
    """torch.compile(fullgraph=True) traces a packed call of a product's layer (the per-step vectors
    come from plain functions made at compile time, no sympy in the trace), equal to eager."""
    from lrdsl.nn import Layer
    torch.manual_seed(0)
    L = Layer(mixers("delta_product2"), 32, 2, 16)
    x = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(14))
    cu = torch.tensor([0, 4, 10])
    torch._dynamo.reset()
    f = torch.compile(lambda t, c: L(t, cu_seqlens=c, cu_seqlens_cpu=[0, 4, 10])[0], backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(f(x, cu), L(x, cu_seqlens=cu)[0])


# ---- FLA's twin: its naive loop on the arguments `lrdsl bench` gives chunk_gated_delta_product -----
def fla_naive(name: str, x: dict, h0: torch.Tensor):
    """FLA's naive_recurrent_gated_delta_product on bench.TWINS[name]'s arguments: o, final state."""
    pytest.importorskip("fla")
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

    from lrdsl.bench import TWINS
    kw = TWINS[name][1](dict(x))
    l2 = lambda t: t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731 (FLA's l2norm_fwd)
    q, k = (l2(kw[n].float()) for n in ("q", "k")) if kw["use_qk_l2norm_in_kernel"] else (kw["q"], kw["k"])
    return naive_recurrent_gated_delta_product(q, k, kw["v"], kw["g"], kw["beta"], kw["scale"],
                                               initial_state=h0.float().clone(), output_final_state=True,
                                               num_householder=kw["num_householder"])


@pytest.mark.parametrize("name", NAMES)
def test_reference_and_chunk_equal_fla_naive(mixers, name):
    """The float64 reference and the chunked kernels equal FLA's naive loop (float32: 1e-5)."""
    mixer = mixers(name)
    x, opts = draw_inputs(mixer, Case(B=2, T=13, H=2, HV=2, K=8, V=6, initial_state=True, seed=3))
    o_fla, S_fla = fla_naive(name, x, opts["initial_state"])
    o, S = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=opts["initial_state"].double(),
                           output_final_state=True)
    assert rms_ratio(o_fla, o) < 1e-5 and rms_ratio(S_fla, S) < 1e-5
    o_c, S_c = mixer.chunk(**x, **opts)
    assert rms_ratio(o_c, o_fla) < 1e-4 and rms_ratio(S_c, S_fla) < 1e-4


def test_a_wrong_step_order_is_caught(mixers):
    """The comparison sees the steps swapped (k2 first): a different model, far outside 1e-5."""
    mixer = mixers("delta_product2")
    x, opts = draw_inputs(mixer, Case(B=2, T=13, H=2, HV=2, K=8, V=6, initial_state=True, seed=3))
    swapped = dict(x, k=x["k2"], k2=x["k"], v=x["v2"], v2=x["v"], b1=x["b2"], b2=x["b1"])
    o_fla, _ = fla_naive("delta_product2", swapped, opts["initial_state"])
    o, _ = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=opts["initial_state"].double())
    assert rms_ratio(o_fla, o) > 1e-2


# ---- the direct sub-mixer without interleaved copies (plan.sub_tokens) -------------------------------
def _interleaved_copies(fn, rows: tuple, widths: tuple) -> list:
    """The copies of vectors of the given widths (K, V) that running fn makes: torch.stack and
    torch.cat of [B, T, heads, K|V] tensors (spied on), and copies and clones of [B, rows, heads,
    K|V] ones (torch.profiler, which records no shapes of a list's tensors)."""
    from unittest import mock

    from torch.profiler import ProfilerActivity, profile
    found = []

    def spy(real):
        def call(tensors, *args, **kwargs):
            found.extend((real.__name__, tuple(t.shape)) for t in tensors if t.dim() == 4 and t.shape[-1] in widths)
            return real(tensors, *args, **kwargs)
        return call
    with mock.patch.object(torch, "stack", spy(torch.stack)), mock.patch.object(torch, "cat", spy(torch.cat)):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn()
    found += [(e.name, s) for e in prof.events() if e.name in ("aten::copy_", "aten::clone")
              for s in e.input_shapes if isinstance(s, list) and len(s) == 4 and s[1] in rows and s[-1] in widths]
    return found


def _loss_backward(mixer, x, opts):
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = mixer.chunk(**leaves, **opts)
    ((o * o).sum() + s.sum()).backward()


@pytest.mark.parametrize("name", ["delta_product2", "delta_product3"])
def test_sub_token_rows_divide_by_no_runtime_integer(name):
    """The sub-mixer's generated kernels find a row's token and step with the constant n, never by
    dividing by the runtime argument sub_n (1 or n): on a GPU that compiled to integer division
    routines in every chunk of the state pass's loop (docs/kernels.md). The text has sub_n's rows
    (the in-place reads are generated) and no `// sub_n` or `% sub_n`."""
    import re

    from lrdsl.codegen.plan import plan
    from lrdsl.codegen.render import render
    sub = lrdsl.compile(EXAMPLES / f"{name}.lr", load_kernels=False).product
    p = plan(sub.ir)
    source = render(p, "test")
    assert p.sub_tokens == int(name[-1]) and "sub_n == 1" in source
    assert not re.search(r"(//|%)\s*sub_n\b", source)


def test_direct_chunk_makes_no_interleaved_copy(mixers, monkeypatch):
    """chunk's forward and backward of delta_product3 copy no q, k or v into a sequence of n T
    sub-tokens: the kernels read step j of token t from the spec's own tensors, in place also where
    they are slices of one tensor. The same count on the copying path (sub-token reads off) finds
    the stacks, so the count sees them where they are."""
    import lrdsl.runtime.product as rp
    mixer = mixers("delta_product3")
    case = Case(B=1, T=20, H=1, HV=1, K=16, V=8, initial_state=True, seed=11)
    x, opts = draw_inputs(mixer, case, DEVICE)
    opts = dict(opts, output_final_state=True)
    run = lambda: _loss_backward(mixer, x, opts)  # noqa: E731
    assert _interleaved_copies(run, (3 * case.T,), (case.K, case.V)) == []
    # keys and values in FLA's layout, slices of one [B, T, n, H, K] tensor: read in place (no copy
    # of any length in the forward; the backward's finite copies, runtime/nonfinite.py, are its own)
    inputs, _, _ = _slices(2)(x)
    with torch.no_grad():
        assert _interleaved_copies(lambda: mixer.chunk(**inputs, **opts), (case.T, 3 * case.T), (case.K, case.V)) == []
        monkeypatch.setattr(rp, "_per_step", lambda mixer, batch: None)
        assert len(_interleaved_copies(lambda: mixer.chunk(**inputs, **opts), (3 * case.T,), (case.K, case.V))) >= 3
    assert len(_interleaved_copies(run, (3 * case.T,), (case.K, case.V))) >= 3


def _check_layout(mixer, case, make):
    """chunk's o, final state and every input's gradient against the float64 reference, with the
    keys and values made by make(x) -> (inputs, leaves, grads of the leaves -> grads by input)."""
    from test_dplr import reference64
    x, opts = draw_inputs(mixer, case, DEVICE)
    opts = dict(opts, output_final_state=True)
    ref_o, ref_s, ref_leaves = reference64(mixer, x, opts)
    do, dS = torch.randn_like(ref_o), torch.randn_like(ref_s)
    ((ref_o * do).sum() + (ref_s * dS).sum()).backward()
    inputs, leaves, unpack = make(x)
    o, s = mixer.chunk(**inputs, **opts)
    ((o * do.float()).sum() + (s * dS.float()).sum()).backward()
    grads = unpack({n: t.grad for n, t in leaves.items()})
    errs = {"o": rms_ratio(o, ref_o), "S": rms_ratio(s, ref_s)}
    errs.update({"d" + n: rms_ratio(grads[n], ref_leaves[n].grad) for n in x})
    return failing(errs)


def _separate(x):
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    return leaves, leaves, lambda g: g


def _transposed(x):
    """Every input a non-contiguous view ([B, heads, T, ...] storage)."""
    leaves = {n: t.transpose(1, 2).contiguous().requires_grad_() for n, t in x.items()}
    return ({n: t.transpose(1, 2) for n, t in leaves.items()}, leaves,
            lambda g: {n: t.transpose(1, 2) for n, t in g.items()})


def _slices(dim):
    """The keys and values as slices of one tensor each: [n, B, T, ...] (dim 0: contiguous steps) or
    [B, T, n, ...] (dim 2: FLA's interleaved layout)."""
    def make(x):
        groups = {"K": ("k", "k2", "k3"), "V": ("v", "v2", "v3")}
        leaves = {n: t.clone().requires_grad_() for n, t in x.items() if n not in groups["K"] + groups["V"]}
        inputs = dict(leaves)
        for kind, names in groups.items():
            names = [n for n in names if n in x]
            leaves[kind] = torch.stack([x[n] for n in names], dim).requires_grad_()
            inputs.update({n: leaves[kind].select(dim, j) for j, n in enumerate(names)})

        def unpack(g):
            out = {n: t for n, t in g.items() if n not in groups}
            for kind, names in groups.items():
                out.update({n: g[kind].select(dim, j) for j, n in enumerate(n for n in names if n in x)})
            return out
        return inputs, leaves, unpack
    return make


@pytest.mark.parametrize("layout", tiered(["separate", "transposed", "steps-first", "steps-inside"],
                                           ["separate", "steps-inside"]))
def test_direct_chunk_gradients_on_every_layout(mixers, layout):
    """Keys and values allocated apart, non-contiguous, or slices of one tensor (the steps first, or
    FLA's [B, T, n, H, K]): chunk's output, final state and every gradient match the reference."""
    make = {"separate": _separate, "transposed": _transposed, "steps-first": _slices(0),
            "steps-inside": _slices(2)}[layout]
    case = Case(B=2, T=13, H=2, HV=2, K=16, V=8, initial_state=True, seed=12)
    bad = _check_layout(mixers("delta_product2"), case, make)
    assert not bad, bad


def test_direct_chunk_with_non_finite_inputs_equals_the_copying_path(mixers, monkeypatch):
    """A nan in a later step's key and an inf in a value: the sub-token path's o and gradients (those
    of a loss on the outputs before them; nan at the bad entries alone, runtime/nonfinite.py) are
    the copying path's, entry for entry."""
    import lrdsl.runtime.product as rp
    mixer = mixers("delta_product2")
    x, opts = draw_inputs(mixer, Case(B=1, T=20, H=1, HV=2, K=16, V=8, initial_state=True, seed=3), DEVICE)
    x["k2"][0, 9, 0, 3] = float("nan")
    x["v"][0, 12, 1, 2] = float("inf")

    def run():
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        o, _ = mixer.chunk(**leaves, **opts)
        o[:, :9].sum().backward()
        return {"o": o, **{n: t.grad for n, t in leaves.items()}}
    new = run()
    monkeypatch.setattr(rp, "_per_step", lambda mixer, batch: None)
    old = run()
    assert int(new["k2"].isnan().sum()) == 1 and int(new["v"].isnan().sum()) == 1
    for n in new:
        torch.testing.assert_close(new[n], old[n], rtol=1e-6, atol=1e-6, equal_nan=True, msg=n)


# ---- GPU (the device machine: LRDSL_TEST_DEVICE=cuda pytest -m gpu tests/test_delta_product.py) -----
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")


def _gpu_inputs(mixer, B=2, T=2048, H=4, HV=4, K=128, V=128, seed=0):
    from test_gpu import draw
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = draw(mixer, B, T, H, HV, K, V, torch.bfloat16, "cuda", gen)
    return x, torch.randn(B, HV, K, V, generator=gen, device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", NAMES)
def test_bf16_chunk_and_gradients_against_the_reference_gpu(name):
    """bf16 inputs, B=2 T=2048 H=4 K=V=128 and packed: chunk and recurrent forward, chunk's
    gradients, against the float64 reference (test_gpu's tolerances)."""
    from test_gpu import _check_backward_bf16
    mixer = lrdsl.compile(EXAMPLES / f"{name}.lr")
    x, h0 = _gpu_inputs(mixer)
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=h0.double(),
                                   output_final_state=True)
    for which in ("chunk", "recurrent"):
        o, s = getattr(mixer, which)(**x, initial_state=h0, output_final_state=True)
        assert rms_ratio(o.double(), ref_o) < 5e-3 and rms_ratio(s.double(), ref_s) < 5e-3, which
    cu = torch.tensor([0, 700, 700, 2048 + 1500, 4096], device="cuda")
    flat = {n: t.reshape(1, 4096, *t.shape[2:]) for n, t in x.items()}
    h0n = torch.randn(4, 4, 128, 128, device="cuda")
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in flat.items()}, initial_state=h0n.double(),
                                   output_final_state=True, cu_seqlens=cu)
    o, s = mixer.chunk(**flat, initial_state=h0n, output_final_state=True, cu_seqlens=cu)
    assert rms_ratio(o.double(), ref_o) < 5e-3 and rms_ratio(s.double(), ref_s) < 5e-3
    _check_backward_bf16(mixer, "chunk bwd")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", NAMES)
def test_bf16_chunk_against_fla_chunk_gpu(name):
    """lrdsl's chunk beside FLA's chunk_gated_delta_product on bench's arguments (H == HV: FLA has
    no grouped values here), bf16: the two agree to bf16's rounding, forward and the initial state's
    and q's gradients."""
    pytest.importorskip("fla")
    from lrdsl.bench import TWINS, _fla
    mixer = lrdsl.compile(EXAMPLES / f"{name}.lr")
    x, h0 = _gpu_inputs(mixer)
    op_name, args = TWINS[name]
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = mixer.chunk(**leaves, initial_state=h0, output_final_state=True)
    leaves_f = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_f, s_f = _fla(op_name)(**args(leaves_f), initial_state=h0, output_final_state=True)
    assert rms_ratio(o, o_f) < 1e-2 and rms_ratio(s, s_f) < 1e-2
    do = torch.randn_like(o)
    (o * do).sum().backward()
    (o_f * do).sum().backward()
    for n in ("q", "k", "v", "g"):
        assert rms_ratio(leaves[n].grad, leaves_f[n].grad) < 2e-2, n


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, layout, HV, packed", [("delta_product2", "separate", 8, False),
                                                      ("delta_product3", "separate", 4, True),
                                                      ("delta_product2", "steps-inside", 4, False)])
def test_sub_token_chunk_equals_the_copying_path_gpu(name, layout, HV, packed, monkeypatch):
    """bf16, B=2 T=2048 H=4 K=V=128 (packed: one row of 4096 tokens, three sequences): the sub-token
    kernels on the spec's own tensors (or on slices of one [B, T, n, H, K] tensor, read in place)
    give o, the final state and every gradient of the copying path (the same kernels on interleaved
    copies: _per_step off), up to 1e-3 (the same products in the same order)."""
    import lrdsl.runtime.product as rp
    mixer = lrdsl.compile(EXAMPLES / f"{name}.lr")
    x, h0 = _gpu_inputs(mixer, HV=HV)
    opts = dict(initial_state=h0, output_final_state=True)
    if packed:
        x = {n: t.reshape(1, 4096, *t.shape[2:]) for n, t in x.items()}
        opts = dict(opts, initial_state=torch.randn(3, HV, 128, 128, device="cuda"),
                    cu_seqlens=torch.tensor([0, 700, 2048 + 1500, 4096], device="cuda"))
    make = _separate if layout == "separate" else _slices(2)
    results = []
    for per_step in (True, False):
        if not per_step:
            monkeypatch.setattr(rp, "_per_step", lambda mixer, batch: None)
        inputs, leaves, unpack = make(x)
        o, s = mixer.chunk(**inputs, **opts)
        gen = torch.Generator(device="cuda").manual_seed(5)
        do, dS = torch.randn(o.shape, generator=gen, device="cuda"), torch.randn(s.shape, generator=gen, device="cuda")
        ((o.float() * do).sum() + (s * dS).sum()).backward()
        results.append((o, s, unpack({n: t.grad for n, t in leaves.items()})))
    (o1, s1, g1), (o2, s2, g2) = results
    assert rms_ratio(o1, o2) < 1e-3 and rms_ratio(s1, s2) < 1e-3
    for n in g2:
        assert rms_ratio(g1[n], g2[n]) < 1e-3, n


def test_a_first_step_without_erase():
    """(I - b k2 k2^T) (exp(g) S + k v^T) + b k2 v2^T: the first step writes without erasing (its
    sub-token reads c = 0 along a = k); every path and gradient against the reference."""
    mixer = lrdsl.compile(text="mixer first_write\ninput q[K] l2norm, k[K] l2norm, k2[K] l2norm, v[V], v2[V], "
                               "b in (0, 1), g log\nS = (I - b k2 k2^T) (exp(g) S + k v^T) + b k2 v2^T\no = S^T q\n")
    assert mixer.ir.delta is None and mixer.ir.n_steps == 2
    out = check_case(mixer, CASES["batch-h0"], DEVICE, grad=True)
    assert out.ok, out.message


@pytest.mark.parametrize("name", ["delta_product2", "delta_product3"])
def test_chain_rule_reads_sub_token_rows_from_the_chunks_token(name):
    """The sub-mixer's chain rule in staged_dk's epilogue (_chain_tokens: k) and where r's gradient
    is made (_chain_at_dr: q) reads its input and stores the gradient at rows step0 + rows from
    row0's token (plan.chain_start, chain_at_start), never at row0 + rows: that 64-bit row, the same
    as the calling kernel's own reads', was kept live into the epilogue, and ptxas spilled 200/212
    in delta_product2's staged_dk (docs/kernels.md). The text has the moves and the reads."""
    from lrdsl.codegen.plan import plan
    from lrdsl.codegen.render import render
    sub = lrdsl.compile(EXAMPLES / f"{name}.lr", load_kernels=False).product
    source = render(plan(sub.ir), "test")
    for fn, x in (("_chain_tokens", "k"), ("_chain_at_dr", "q")):
        body = source[source.index(f"def {fn}("):]
        body = body[:body.index("\n\n\n")]
        assert f"in_{x} += tok0 * rs_{x}" in body and f"d_{x}_ptr += tok0 * HV * K" in body, fn
        assert "(step0 + rows[:, None])" in body and "row0 + rows" not in body, fn
